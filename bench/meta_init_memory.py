"""Peak host memory per rank of building a model on the meta device and sharding it (FSDP2).

plait builds a `META_INIT` model on the meta device when the world size is > 1, applies the
parallel plugins, then allocates and initialises only each rank's shards
(`strategies.meta_init`, `MeshStrategy.materialize`). Before that, every rank held the whole fp32
model first. This bench runs the real CLI (``plait pretrain``, gloo processes on CPU) with a
callback that, at ``on_train_start`` (model built, sharded and moved, optimizer configured, no
step taken: Adam's moments do not exist yet), prints each rank's peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``: the whole process, Python and torch included) and the bytes
of its local parameter shards, then ends the process.

Reported per rank: peak RSS / the full fp32 model's bytes (4 x the global parameter count).
Issue 15's target for ``llama3_1b`` on 4 ranks: at most 0.45.

Invocations::

    python bench/meta_init_memory.py                                  # llama3_1b, fsdp, 4 ranks: ~40 s, ~7 GiB in all
    python bench/meta_init_memory.py --model llama3_1b --devices 2

The last line is ``RESULT peak_rss_over_model_bytes=<max over ranks> local_param_fraction=<x>``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl

LINE = re.compile(r"RSSPROBE rank=(\d+) peak_rss_bytes=(\d+) global_params=(\d+) local_param_bytes=(\d+)")


class RSSProbe(pl.Callback):
    """Prints the rank's peak RSS and local parameter bytes at ``on_train_start``, then exits 0."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        params = list(pl_module.parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() for p in params)
        total = sum(p.numel() for p in params)  # a DTensor's numel is the global one
        print(
            f"RSSPROBE rank={trainer.global_rank} peak_rss_bytes={peak} global_params={total} local_param_bytes={local}",
            flush=True,
        )
        os._exit(0)  # no step: Adam's moments would be the next allocation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", default="fsdp")
    args = parser.parse_args()
    plait = Path(sys.executable).with_name("plait")
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            str(plait),
            "pretrain",
            f"run_dir={run_dir}/run",
            f"model={args.model}",
            f"strategy={args.strategy}",
            f"trainer.devices={args.devices}",
            "trainer.max_steps=1",
            "data.seq_len=256",
            f"train.global_batch_size={args.devices}",
            "+callbacks.rss._target_=meta_init_memory.RSSProbe",
        ]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
        )
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    rows = sorted((int(r), int(p), int(n), int(b)) for r, p, n, b in LINE.findall(out.stdout))
    if len(rows) != args.devices:
        sys.exit(
            f"expected {args.devices} RSSPROBE lines, got {len(rows)}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        )
    model_bytes = 4 * rows[0][2]
    print(
        f"{args.model}: {rows[0][2]:,} parameters, full fp32 model {model_bytes / 2**30:.2f} GiB; strategy={args.strategy}, {args.devices} ranks"
    )
    for rank, peak, _, local in rows:
        print(
            f"  rank {rank}: peak RSS {peak / 2**30:.2f} GiB = {peak / model_bytes:.3f} x model; local shards {local / 2**30:.2f} GiB"
        )
    worst = max(peak for _, peak, _, _ in rows) / model_bytes
    print(f"RESULT peak_rss_over_model_bytes={worst:.3f} local_param_fraction={rows[0][3] / model_bytes:.4f}")


if __name__ == "__main__":
    main()
