"""One-GPU throughput of plait on a Llama 3.2 1B-shaped model: tokens/s, TFLOP/s, MFU, peak memory.

    python bench/gpu.py                      # 30 steps, 4 x 2048 tokens, bf16 autocast
    python bench/gpu.py --compile            # per-block torch.compile (strategy.compile.enabled)
    python bench/gpu.py --peak-tflops 989    # peak dense bf16 TFLOP/s of the GPU for MFU

It runs plait's real path (recipe -> build_run -> Lightning fit) on the bundled corpus, without
checkpoints. At world size 1 no FSDP wrapping is applied (there is nothing to shard), so bf16 comes
from Lightning's ``bf16-mixed`` autocast; the multi-GPU FSDP2 path is the same code with
``trainer.devices=N strategy=fsdp``. Steps before ``--warmup`` are not timed (compilation, allocator
warm-up). Model FLOPs per token follow ``Llama.flops_per_token`` (6N + attention; PaLM appendix B).
Without CUDA the script says so and exits 0. Last line: ``RESULT key=value ...``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

# Dense bf16 peaks (TFLOP/s, no sparsity) by device-name substring.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


class StepTimer(L.Callback):
    """Times training steps after a warm-up, synchronising the GPU at each step's edges."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.tokens = warmup, [], []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        torch.cuda.synchronize()
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)
            self.tokens.append(pl_module.last_step_tokens)
        if trainer.global_step == self.warmup:
            torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU; none is available here, so nothing was measured.")
        print("RESULT skipped=no_cuda")
        return

    from trainer.build import build_run
    from trainer.compose import compose

    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    overrides = [
        f"model={args.model}",
        f"data.seq_len={args.seq_len}",
        "data.eval_rows=8",
        f"train.global_batch_size={args.batch}",
        f"trainer.max_steps={args.steps}",
        "train.eval_every=0",
        "trainer.accelerator=gpu",
        "trainer.devices=1",
        "trainer.precision=bf16-mixed",
        "trainer.enable_progress_bar=false",
        "logger=none",
        "~callbacks.checkpoint",
        "~callbacks.plots",
        f"strategy.compile.enabled={str(args.compile).lower()}",
        "+callbacks.timer._target_=__main__.StepTimer",
        f"+callbacks.timer.warmup={args.warmup}",
    ]
    cfg = compose("pretrain", overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer, task, data = build_run(cfg, Path(run_dir))
        trainer.fit(task, datamodule=data)
    timer = next(cb for cb in trainer.callbacks if isinstance(cb, StepTimer))
    tokens_per_s = sum(timer.tokens) / sum(timer.times)
    tflops = tokens_per_s * task.flops_per_token / 1e12
    mfu = tflops / peak if peak else float("nan")
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    print(f"device {name}; model {args.model} ({task.model.num_params() / 1e9:.2f} B params); "
          f"{args.batch} x {args.seq_len} tokens per step; {len(timer.times)} timed steps; compile={args.compile}")
    print(f"tokens/s {tokens_per_s:,.0f}  TFLOP/s {tflops:.1f}  MFU {mfu:.3f} (peak {peak} TFLOP/s)  peak memory {peak_gib:.1f} GiB")
    print(f"RESULT tokens_per_s={tokens_per_s:.0f} tflops={tflops:.1f} mfu={mfu:.4f} peak_mem_gib={peak_gib:.2f} "
          f"compile={int(args.compile)}")


if __name__ == "__main__":
    main()
