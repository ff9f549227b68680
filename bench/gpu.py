"""One-GPU throughput of plait through its real path (recipe -> build_run -> fit): tokens/s, MFU, memory.

    python bench/gpu.py                          # every configuration below, each in its own process
    python bench/gpu.py --configs 1b_docs,1b_causal --budget-s 300
    python bench/gpu.py --allow-cpu              # the tiny smoke configuration on CPU (CI keeps it working)

Configurations (`CONFIGS`, most important first): Llama 3.2 1B at 8192 x 2 rows with document masks
(FlexAttention) and the same with plain causal rows (torchtitan's published setting: no document ids,
positions 0..T-1, SDPA flash); an 8B shape cut to 8 layers at 8192 x 1; eager and unfused variants of
the 1B (compile off; whole-logits loss and per-tensor AdamW); and the longest trainable sequence at
cp=1 (doubling from 16k with selective activation checkpointing until a step runs out of memory).
All start from ``trainer=gpu`` (bf16-mixed, TF32, per-block compile, fused AdamW, fused chunked loss)
with ``data.val_fraction=0`` (no evaluation pass) and no checkpoints.

Per configuration: tokens/s/GPU, step time (median, max), TFLOP/s and MFU by torchtitan's formula
(``Llama.flops_per_token``: 6N + 12 L D T; peak 989 TFLOP/s dense bf16 for H100/H200), the attention
kernel the shapes dispatch to, peak allocated/reserved memory of the timed training steps, the first
step's time (compilation), the last loss and whether every loss was finite; an out-of-memory is a
result (``oom=1``). One JSON line per configuration (``--json``) and a final ``RESULT key=value ...``.
Runs on torch 2.11 (the lease machine's) and 2.13.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
ONE_B = dict(model="llama3_1b", seq_len=8192, batch=2)
CONFIGS: dict[str, dict] = {
    "1b_docs": ONE_B,
    "1b_causal": {**ONE_B, "causal": True},
    "8b_8layers": dict(model="llama3_8b", layers=8, seq_len=8192, batch=1),
    "1b_docs_eager": {**ONE_B, "compile": False},
    "1b_causal_eager_unfused": {**ONE_B, "causal": True, "compile": False, "unfused": True},
    "1b_longest": dict(model="llama3_1b", seq_len=16384, batch=1, ac="selective", steps=4, warmup=2, longest=True),
    "smoke": dict(model="nano", seq_len=64, batch=2, steps=3, warmup=1, compile=False),
}
LONGEST_CAP = 262144  # tokens: the search stops doubling here


class StepTimer(L.Callback):
    """Times steps after ``warmup`` (synchronised edges); peak memory of the timed steps only.

    With ``causal`` it drops each batch's document and position ids before the step (plain causal
    rows over the whole packed row, as torchtitan trains).
    """

    def __init__(self, warmup: int, causal: bool) -> None:
        self.warmup, self.causal = warmup, causal
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.losses: list[float] = []
        self.first_step_s = float("nan")
        self.peak_alloc = self.peak_reserved = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, *args: object
    ) -> None:
        if self.causal:
            batch.pop("document_ids", None)
            batch.pop("position_ids", None)
        _sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        _sync()
        elapsed, step = time.perf_counter() - self._start, trainer.global_step
        if step == 1:
            self.first_step_s = elapsed  # includes compilation
        if step > self.warmup:
            self.times.append(elapsed)
            self.tokens.append(pl_module.last_step_tokens)
            self.losses.append(pl_module.history[-1]["loss"])
            if torch.cuda.is_available():  # read before any end-of-run evaluation raises the peak
                self.peak_alloc = torch.cuda.max_memory_allocated() / 2**30
                self.peak_reserved = torch.cuda.max_memory_reserved() / 2**30
        if step == self.warmup and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def attention_kernel(spec: dict, n_heads: int, n_kv_heads: int, head_dim: int) -> str:
    """The kernel plait's attention core picks for these rows: ``flex`` (document masks on CUDA),
    the SDPA backend of plain causal rows, or ``cpu_*`` on CPU."""
    if not torch.cuda.is_available():
        return "cpu_causal_sdpa" if spec.get("causal") else "cpu_per_document_sdpa"
    if not spec.get("causal"):
        return "flex"
    from torch.nn.attention import SDPBackend

    T = spec["seq_len"]
    q = torch.empty(1, n_heads, T, head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(1, n_kv_heads, T, head_dim, device="cuda", dtype=torch.bfloat16)
    return SDPBackend(torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=True)).name


def overrides(spec: dict, seq_len: int, cuda: bool) -> list[str]:
    """The plait command line of one configuration (``cuda``: from the ``trainer=gpu`` preset)."""
    out = [
        f"model={spec['model']}",
        f"data.seq_len={seq_len}",
        "data.val_fraction=0",
        "train.eval_every=0",
        f"train.global_batch_size={spec['batch']}",
        f"trainer.max_steps={spec.get('steps', 12)}",
        "trainer.devices=1",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1000",
        "logger=none",
        "~callbacks.checkpoint",
        "~callbacks.plots",
        f"strategy.compile.enabled={str(spec.get('compile', cuda)).lower()}",
        f"strategy.activation_checkpoint.mode={spec.get('ac', 'none')}",
    ]
    out.insert(0, "trainer=gpu" if cuda else "trainer.accelerator=cpu")
    if spec.get("layers"):
        out.append(f"model.n_layers={spec['layers']}")
    if spec["model"].startswith("llama3"):
        out.append(f"model.max_seq_len={max(seq_len, 8192)}")
    if spec.get("unfused"):
        out += ["objective.loss_chunk_tokens=0", "optim.fused=false"]
    return out


def run_one(name: str, seq_len: int) -> dict:
    """Trains one configuration in this process; returns its figures (``oom=1`` if it ran out of memory)."""
    from trainer.build import build_run
    from trainer.compose import compose

    spec, cuda = CONFIGS[name], torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), float("nan"))
    cfg = compose("pretrain", overrides(spec, seq_len, cuda))
    m = cfg.model
    head_dim = m.dim // m.n_heads
    result = {
        "config": name,
        "device": device,
        "torch": torch.__version__,
        "seq_len": seq_len,
        "batch": spec["batch"],
        "layers": m.n_layers,
        "compile": cfg.strategy.compile.enabled,
        "causal_rows": bool(spec.get("causal")),
        "ac": spec.get("ac", "none"),
        "attention": attention_kernel(
            {**spec, "seq_len": seq_len}, m.n_heads, m.get("n_kv_heads") or m.n_heads, head_dim
        ),
    }
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            trainer, task, data = build_run(cfg, Path(run_dir))
            timer = StepTimer(spec.get("warmup", 4), causal=bool(spec.get("causal")))
            trainer.callbacks.append(timer)
            result["setup_s"] = round(time.perf_counter() - start, 1)
            trainer.fit(task, datamodule=data)
        steps = sorted(timer.times)
        tps = sum(timer.tokens) / sum(timer.times)
        tflops = tps * task.flops_per_token / 1e12
        result.update(
            oom=0,
            params_b=round(task.model.num_params() / 1e9, 3),
            tokens_per_s=round(tps),
            step_ms_median=round(1e3 * steps[len(steps) // 2], 1),
            step_ms_max=round(1e3 * steps[-1], 1),
            tflops=round(tflops, 1),
            mfu=round(tflops / peak, 4),
            peak_alloc_gib=round(timer.peak_alloc, 2),
            peak_reserved_gib=round(timer.peak_reserved, 2),
            first_step_s=round(timer.first_step_s, 1),
            loss_last=round(timer.losses[-1], 4),
            loss_finite=all(math.isfinite(x) for x in timer.losses),
        )
    except torch.OutOfMemoryError as err:
        result.update(oom=1, error=str(err).splitlines()[0][:160])
    result["total_s"] = round(time.perf_counter() - start, 1)
    return result


def launch(name: str, seq_len: int, json_path: Path, timeout_s: float) -> dict:
    """Runs one configuration in a child process (a crash or OOM leaves the others intact)."""
    cmd = [sys.executable, __file__, "--one", name, "--seq-len", str(seq_len), "--json", str(json_path)]
    before = json_path.read_text().count("\n") if json_path.exists() else 0
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"config": name, "seq_len": seq_len, "error": f"timeout {timeout_s:.0f}s"}
    lines = json_path.read_text().splitlines() if json_path.exists() else []
    if proc.returncode or len(lines) == before:
        return {"config": name, "seq_len": seq_len, "error": f"rc={proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(n for n in CONFIGS if n != "smoke"))
    parser.add_argument("--budget-s", type=float, default=540.0, help="no configuration starts after this")
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per configuration")
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run the smoke configuration")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one configuration
    parser.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = run_one(args.one, args.seq_len)
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")
        return
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench/gpu.py needs a CUDA GPU (or --allow-cpu for the smoke run); nothing was measured.")
        print("RESULT skipped=no_cuda")
        return
    names = args.configs.split(",") if torch.cuda.is_available() else ["smoke"]
    json_path = args.json or Path(tempfile.mkdtemp()) / "gpu.jsonl"
    start, results = time.perf_counter(), []
    for name in names:
        seq_len = CONFIGS[name]["seq_len"]
        while (left := args.budget_s - (time.perf_counter() - start)) > 30:
            result = launch(name, seq_len, json_path, left)
            results.append(result)
            print(json.dumps(result), flush=True)
            if not CONFIGS[name].get("longest") or result.get("oom", 1) or seq_len * 2 > LONGEST_CAP:
                break
            seq_len *= 2
    summary = []
    for r in results:
        key = r["config"] + (f"_{r['seq_len']}" if CONFIGS[r["config"]].get("longest") else "")
        if r.get("oom") == 0:
            summary.append(
                f"{key}_tps={r['tokens_per_s']} {key}_mfu={r['mfu']} {key}_gib={r['peak_alloc_gib']}"
                f" {key}_finite={int(r['loss_finite'])}"
            )
        else:
            summary.append(f"{key}_failed={'oom' if r.get('oom') else 'error'}")
    longest = max(
        (r["seq_len"] for r in results if CONFIGS[r["config"]].get("longest") and r.get("oom") == 0), default=0
    )
    print("RESULT " + " ".join(summary) + (f" longest_seq_len={longest}" if longest else ""))


if __name__ == "__main__":
    main()
