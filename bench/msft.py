"""mSFT budget search vs the best uniform epoch count and a per-source early-stopping oracle.

The paper's regime (Koh et al., research/seed_papers.md section 5): fine-tune a *pretrained* base
on a real multi-task mixture. The bench first pretrains a tiny Llama on the bundled corpus
(Shakespeare + King James Bible, ``--base-steps`` steps of the ``pretrain`` recipe, its own BPE
tokenizer) once and caches it under ``$PLAIT_CACHE_DIR/bench/``; every fine-tuning run starts from
it (``model.init_from``, the base's tokenizer). The mixture is the bundled SFT sources of clearly
different size and kind: alpaca (general, 999 conversations), glaive (tool calls, 300), humaneval
(code, 164), champ (math, 270), ifbench (instruction following, 294), ``--val-size`` held out each.

- mSFT (`trainer.budget.msft`): roll-outs of ``--compute`` more epochs of the active sources,
  every source scored on its held-out set every ``--eval-every`` steps, roll back to the earliest
  optimum, remove that source, repeat (``--patience``: a roll-out ends once its pick is settled).
- Uniform: every source ``--compute`` epochs in one run, its best checkpoint by mean score (the
  best uniform epoch count).
- Oracle: each source's best held-out loss at any checkpoint of the uniform run (one early stop per
  source; a bound, not one model).

Score: minus the held-out loss of each source (reported as the mean held-out loss, lower is
better). FLOPs: training tokens x the model's FLOPs per token, every roll-out counted in full
(also the steps a roll-back discards); the uniform run counts its whole run. Also printed: each
source's held-out loss when mSFT removed it and in the final model (forgetting after removal).

Cuts that keep the regime (the figure in docs/benchmarks.md uses them): ``--base-stop K`` takes the
base at step K of its schedule, ``--fraction f`` keeps the first f of each source's training
conversations; ``--compute``, ``--eval-every`` and ``--val-size`` apply to both arms alike.

Invocations (costs measured at ~1.2 CPU s per fine-tuning step of 8 x 256 tokens with its share of
evaluations, ~0.9 per base step; one process, so an idle core's wall time is about the CPU time)::

    OMP_NUM_THREADS=1 python bench/msft.py      # whole mixture, C = 4, 2000-step base: ~2 h (estimated, not run)
    OMP_NUM_THREADS=1 python bench/msft.py --base-stop 1030 --fraction 0.25 --compute 2 --eval-every 30 --val-size 16
        # the docs' figure: 395 search + 244 uniform steps, 741 CPU s (59 min wall at load 6-10)
    python bench/msft.py --regime synthetic     # the earlier setting: nano from scratch, synthetic tasks (~5 min)

The last line is ``RESULT msft_metric=<x> uniform_metric=<y> oracle_metric=<z> msft_flops_ratio=<mSFT/uniform>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from trainer.budget.msft import MSFT, fit_run
from trainer.compose import compose

SOURCES = ("general", "tool_use", "code", "math", "instruction_following")  # conf/data/sft.yaml


class StopAtStep(L.Callback):
    """Ends a run after optimizer step ``step`` (the checkpoint callback saves it at train end); the
    LR schedule still spans ``trainer.max_steps``: a run cut short, not a shorter run."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def pretrained_base(args: argparse.Namespace) -> Path:
    """The cached base run directory (pretrained on the bundled corpus), trained on a cache miss.

    ``args.base_steps``: the pretraining schedule (warm-up + cosine decay) in optimizer steps;
    ``args.base_stop`` (None: the whole schedule): the step the base is taken at."""
    from trainer.build import build_data

    overrides = [
        f"model={args.model}", f"data.seq_len={args.seq_len}", f"trainer.max_steps={args.base_steps}",
        "train.eval_every=0", "trainer.enable_progress_bar=false", f"trainer.log_every_n_steps={args.base_steps}",
        "logger=csv", "~callbacks.plots", f"callbacks.checkpoint.every_n_steps={args.base_steps}",
    ]  # fmt: skip
    stop = getattr(args, "base_stop", None)
    if stop is not None and stop < args.base_steps:
        overrides.append(f"+callbacks.stop_at={{_target_: {Path(__file__).stem}.StopAtStep, step: {stop}}}")
    key = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:12]
    base = Path(os.environ.get("PLAIT_CACHE_DIR", "~/.cache/plait")).expanduser() / "bench" / f"msft_base_{key}"
    done = base / "complete.json"  # written once the last step's checkpoint is saved
    if done.is_file():
        return base
    cfg = compose("pretrain", overrides)
    last = base / "checkpoints" / "last"
    partial = last.exists() and (base / "tokenizer.json").is_file()  # an interrupted run: resume it
    if not partial:
        build_data(cfg).prepare().tokenizer.save(base / "tokenizer.json")
    start = time.perf_counter()
    history = fit_run(cfg, base, ckpt_path=str(last.resolve()) if partial else None)
    val = [h["val_loss"] for h in history if "val_loss" in h]
    seconds = time.perf_counter() - start
    done.write_text(json.dumps({"steps": args.base_steps, "val_loss": val[-1] if val else None, "seconds": seconds}))
    print(
        f"base: step {stop or args.base_steps} of a {args.base_steps}-step schedule{' (resumed)' if partial else ''}, "
        f"val loss {val}, {seconds:.0f} s"
    )
    return base


def finetune_overrides(args: argparse.Namespace, base: Path | None) -> list[str]:
    common = [
        f"train.global_batch_size={args.batch}", f"optim.lr={args.lr}", "scheduler=constant",
        "scheduler.warmup_steps=10", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=5",
        "logger=csv", "~callbacks.plots",
    ]  # fmt: skip
    if args.regime == "synthetic":
        return [
            "data=synthetic",
            "model=nano",
            "model.max_seq_len=64",
            *common,
            *(f"data.sources.{n}.metric=loss" for n in ("reversal", "sorting", "addition")),
        ]
    return [
        f"model={args.model}", f"model.init_from={base}", f"data.tokenizer={base / 'tokenizer.json'}",
        f"data.seq_len={args.seq_len}", *common, *(f"data.sources.{n}.val_size={args.val_size}" for n in SOURCES),
        *(f"++data.sources.{n}.limit={k}" for n, k in limits(args.fraction, args.val_size).items()),
    ]  # fmt: skip


def limits(fraction: float, val_size: int) -> dict[str, int]:
    """``data.sources.<name>.limit`` keeping ``fraction`` of each source's training conversations
    (the first ones; the held-out ``val_size`` stay as they are); {} for the whole mixture."""
    from trainer.data import instructions

    if fraction >= 1.0:
        return {}
    sft = compose("sft", []).data.sources
    return {n: max(1, round(fraction * (len(getattr(instructions, sft[n].source)()) - val_size))) for n in SOURCES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--regime", choices=("pretrained", "synthetic"), default="pretrained")
    parser.add_argument("--compute", type=float, default=4.0)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--fraction", type=float, default=1.0, help="of each source's training conversations")
    parser.add_argument("--base-steps", type=int, default=2000, help="the base's pretraining schedule, optimizer steps")
    parser.add_argument("--base-stop", type=int, default=None, help="take the base at this step of its schedule")
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = parser.parse_args()
    if args.regime == "synthetic":  # the settings of the earlier figure (docs/benchmarks.md)
        args.compute, args.eval_every, args.batch, args.lr = 3.0, 15, 16, 3e-3

    start = time.perf_counter()
    base = pretrained_base(args) if args.regime == "pretrained" else None
    cfg = compose("sft", finetune_overrides(args, base))
    out = Path(args.out or tempfile.mkdtemp(prefix="plait-msft-"))
    report = MSFT(compute=args.compute, eval_every=args.eval_every, patience=args.patience, baseline=True).run(cfg, out)

    # Scores are minus held-out losses: report the losses themselves.
    uniform = report["uniform"]
    names = list(report["sources"])
    oracle = {n: max(s[n] for _, s in uniform["curve"] if n in s) for n in names}
    msft_metric, uniform_metric = -report["final_mean"], -uniform["best_mean"]
    oracle_metric = -sum(oracle.values()) / len(oracle)
    ratio = report["flops"] / uniform["flops"]
    print(
        f"\n{'source':<24} {'removed at':>10} {'loss then':>9} {'final':>7} {'forgot':>7} {'uniform':>8} {'oracle':>7}"
    )
    for n in names:
        stop = report["sources"][n]
        then, final = -stop["score"], -report["final_scores"][n]
        print(
            f"{n:<24} {stop['step']:>10} {then:>9.3f} {final:>7.3f} {final - then:>+7.3f} "
            f"{-uniform['scores'][n]:>8.3f} {-oracle[n]:>7.3f}"
        )
    print(
        f"held-out loss: mSFT {msft_metric:.4f}, best uniform {uniform_metric:.4f} (step {uniform['best_step']} of "
        f"{uniform['steps']}), oracle {oracle_metric:.4f}; FLOPs mSFT/uniform {ratio:.3f}; "
        f"{time.perf_counter() - start:.0f} s; run directory {out}"
    )
    print(
        f"RESULT msft_metric={msft_metric:.4f} uniform_metric={uniform_metric:.4f} oracle_metric={oracle_metric:.4f} "
        f"msft_flops_ratio={ratio:.3f}"
    )


if __name__ == "__main__":
    main()
