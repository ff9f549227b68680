"""The LM head and loss of one CPU step with glibc's defaults and with `strategy.cpu_allocator=keep_freed`.

Each arm runs in a fresh interpreter (the setting is process-wide and permanent), the arms
alternate for ``--rounds`` rounds, and each round times ``--iters`` repeats of:

- ``gemm``: the LM head's forward GEMM, ``[N, D] @ [D, V]`` into a fresh ``[N, V]`` fp32 output;
- ``tail``: plait's final norm, LM head and summed cross-entropy (`trainer.objectives.pretrain.token_loss_sum`),
  forward and backward, as one step of the 7.4M peer workload runs them (N = 2,048 tokens, D = 256, V = 8,192).

Prints each arm's median milliseconds and ``RESULT gemm_system_over_keep=... tail_system_over_keep=...``
(above 1: keep_freed is faster).

    OMP_NUM_THREADS=2 python bench/host_allocator.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ARM = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
from strategies.runtime.host_allocator import keep_freed_host_memory
from trainer.models.norm import RMSNorm
from trainer.objectives.pretrain import token_loss_sum
if {keep}:
    assert keep_freed_host_memory()
torch.manual_seed(0)
N, D, V, iters = {tokens}, {dim}, {vocab}, {iters}
hidden = torch.randn(1, N, D, requires_grad=True)
norm, head = RMSNorm(D), torch.nn.Linear(D, V, bias=False)
labels = torch.randint(0, V, (1, N))
def gemm():
    hidden.detach() @ head.weight.detach().t()
def tail():
    token_loss_sum(head(norm(hidden)), labels).backward()
out = {{}}
for name, fn in [("gemm", gemm), ("tail", tail)]:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    out[name] = (time.perf_counter() - start) / iters * 1e3
print("ARM " + json.dumps(out))
"""


def run_arm(keep: bool, args: argparse.Namespace) -> dict[str, float]:
    code = ARM.format(root=str(ROOT), keep=keep, tokens=args.tokens, dim=args.dim, vocab=args.vocab, iters=args.iters)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ARM "))[4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"system": [], "keep_freed": []}
    for _ in range(args.rounds):
        runs["system"].append(run_arm(False, args))
        runs["keep_freed"].append(run_arm(True, args))
    median = {arm: {k: statistics.median(r[k] for r in rs) for k in ("gemm", "tail")} for arm, rs in runs.items()}
    for arm, ms in median.items():
        print(f"{arm:>10}: head GEMM {ms['gemm']:.1f} ms, norm + head + loss fwd/bwd {ms['tail']:.1f} ms (medians)")
    ratio = {k: median["system"][k] / median["keep_freed"][k] for k in ("gemm", "tail")}
    print(f"RESULT gemm_system_over_keep={ratio['gemm']:.3f} tail_system_over_keep={ratio['tail']:.3f}")


if __name__ == "__main__":
    main()
