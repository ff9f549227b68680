"""Training time blocked per checkpoint save: asynchronous (``callbacks.checkpoint.async_save=true``) over synchronous.

One process trains a stack of Linear layers with AdamW (``--layers`` x [dim, 4 dim] + [4 dim, dim];
the default: 25M parameters, 302 MB of model and optimizer state) for ``--steps`` steps and saves a
checkpoint every ``--every`` steps but the last (each save has steps after it to overlap) through
`strategies.checkpoint.dcp.save`, as `trainer.callbacks.checkpoint.PeriodicCheckpoint` does:
synchronously, or with an `AsyncWriter` (each step asks whether the write is done and, once it is,
seals the checkpoint; a save finishes the one in flight first). Blocked time is what the training
loop spends inside those calls: the whole write for a synchronous save; the checks, the staging copy
and the seal (manifest, rename) for an asynchronous one. The wait for the last write at the end of
the loop is printed apart. Each checkpoint is verified afterwards.

Also printed: the mean step time while a background write runs and while none does (the write
competes with training for the cores), and each arm's wall time.

    python bench/async_ckpt.py                 # ~2 minutes on 2 cores
    python bench/async_ckpt.py --layers 4      # a smaller state

The last line is ``RESULT blocked_ratio=<async blocked per save / sync blocked per save> ...``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strategies.checkpoint import dcp as ckpt  # noqa: E402
from strategies.checkpoint.async_save import AsyncWriter  # noqa: E402


def _model(dim: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers)]
    model = nn.Sequential(*blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    return params + moments


def run_arm(background: bool, args: argparse.Namespace, root: Path) -> dict[str, float]:
    """Trains ``args.steps`` steps saving every ``args.every``; the seconds blocked and the step times."""
    model, optimizer = _model(args.dim, args.layers)
    batch = torch.randn(args.rows, args.dim)
    writer = AsyncWriter() if background else None
    blocked: list[float] = []  # per save: its call plus its seal
    overlapped, quiet = [], []  # step seconds with and without a write in the background
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        if writer is not None:
            writer.begin_poll()
        writing = writer is not None and writer.pending
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        (overlapped if writing else quiet).append(time.perf_counter() - t0)
        if writer is not None and writer.all_written():
            t1 = time.perf_counter()
            writer.finish()
            blocked[-1] += time.perf_counter() - t1
        if step % args.every == 0 and step < args.steps:  # periodic saves; each has steps after it to overlap
            t1 = time.perf_counter()
            if writer is not None and writer.pending:  # the save would wait for it: counted against this save
                writer.finish()
            path = root / f"step_{step:07d}"
            ckpt.save(path, model=model, optimizers=[optimizer], meta={"global_step": step}, writer=writer)
            blocked.append(time.perf_counter() - t1)
    t1 = time.perf_counter()
    if writer is not None:
        writer.finish()  # the end of training: no step is left to overlap (reported, not counted per save)
        writer.close()
    end_wait = time.perf_counter() - t1
    wall = time.perf_counter() - start
    for path in sorted(root.glob("step_*")):
        assert ckpt.verify_checkpoint(path) is None, path
    return {
        "blocked": statistics.mean(blocked),
        "each": blocked,
        "step_overlapped": statistics.mean(overlapped) if overlapped else float("nan"),
        "step_quiet": statistics.median(quiet),
        "wall": wall,
        "end_wait": end_wait,
        "state_mb": _state_bytes(model, optimizer) / 1e6,
        "disk_mb": sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 1e6 / len(blocked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="rows per training step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="steps between saves")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    results = {}
    for name, background in (("sync", False), ("async", True)):
        root = Path(tempfile.mkdtemp(prefix=f"plait-async-{name}-", dir=args.dir))
        try:
            results[name] = run_arm(background, args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        r = results[name]
        print(
            f"{name:>5}: blocked {r['blocked']:.3f} s per save ({r['state_mb']:.0f} MB of state, "
            f"{r['disk_mb']:.0f} MB on disk); step {r['step_quiet'] * 1e3:.0f} ms without a write in flight, "
            f"{r['step_overlapped'] * 1e3:.0f} ms with one; {r['wall']:.1f} s for {args.steps} steps "
            f"({r['end_wait']:.2f} s of it waiting for the last write at the end); "
            f"each save: {', '.join(f'{b:.3f}' for b in r['each'])} s",
            flush=True,
        )
    sync, asyn = results["sync"], results["async"]
    print(
        f"RESULT blocked_ratio={asyn['blocked'] / sync['blocked']:.3f} sync_blocked_s={sync['blocked']:.3f} "
        f"async_blocked_s={asyn['blocked']:.3f} state_mb={sync['state_mb']:.0f} "
        f"wall_ratio={asyn['wall'] / sync['wall']:.3f}"
    )


if __name__ == "__main__":
    main()
