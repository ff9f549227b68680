"""Mixout vs plain fine-tuning: the spread of the final held-out loss across seeds (Mixout's claim).

Lee, Cho and Kang 2020 report that Mixout makes fine-tuning a large pretrained model on a small
set much more stable across random seeds. Here: the pretrained tiny base of ``bench/msft.py``
(pretrained once on the bundled corpus and cached), fine-tuned with the ``sft`` recipe on one small
bundled source (``--source``, default champ: 270 math conversations) for ``--epochs`` epochs at a
constant ``--lr`` (AdamW), once per seed with and without `strategies.transforms.mixout.Mixout` (``--p``).
The held-out conversations (32, never trained on) are the same in every run; a seed is the order
of the training conversations (and the Mixout masks). Reported per arm: the final held-out loss
of every seed, their mean, standard deviation and variance.

Invocations::

    OMP_NUM_THREADS=1 python bench/mixout.py   # champ, 6 epochs, 5 seeds x 2 arms: ~45 min on an idle core (estimate)
    OMP_NUM_THREADS=1 python bench/mixout.py --base-stop 1030 --source humaneval --epochs 2
        # the docs' figure: 553 CPU s (~9 min on an idle core; 51 min wall at load 6-10)
    python bench/mixout.py --p 0.9 --lr 3e-3 --epochs 8

The last line is ``RESULT mixout_var=<x> plain_var=<y> var_ratio=<mixout/plain> mixout_mean=<a> plain_mean=<b>``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from msft import SOURCES, pretrained_base  # noqa: E402  (the shared cached base)

from trainer.budget.msft import fit_run  # noqa: E402
from trainer.compose import compose  # noqa: E402

HELD_OUT = 32


def write_split(source: str, seeds: int, tmp: Path) -> tuple[Path, list[Path]]:
    """A fixed held-out file of the source and one training file per seed (the rest, in that seed's order)."""
    from trainer.data import instructions

    conversations = getattr(instructions, source)()
    order = list(range(len(conversations)))
    random.Random(0).shuffle(order)
    held_out, rest = order[:HELD_OUT], order[HELD_OUT:]

    def write(path: Path, indices: list[int]) -> Path:
        path.write_text("".join(json.dumps({"messages": conversations[i]}) + "\n" for i in indices))
        return path

    train_files = []
    for seed in range(seeds):
        shuffled = list(rest)
        random.Random(seed).shuffle(shuffled)
        train_files.append(write(tmp / f"train_{seed}.jsonl", shuffled))
    return write(tmp / "held_out.jsonl", held_out), train_files


def finetune(
    args: argparse.Namespace, base: Path, data: tuple[Path, Path], seed: int, p: float | None, run_dir: Path
) -> float:
    """Final loss on the held-out conversations of one fine-tuning run.

    The split and the mixture's seed stay fixed; the seed orders the training file (and seeds Mixout)."""
    held_out, train = data
    overrides = [
        f"model={args.model}", f"model.init_from={base}", f"data.tokenizer={base / 'tokenizer.json'}",
        f"data.seq_len={args.seq_len}", *(f"~data.sources.{n}" for n in SOURCES),
        f"+data.sources.train={{source: {train}, weight: 1.0, max_tokens: null, max_epochs: {args.epochs}, val_size: 0}}",
        # Never trained on (no token budget): its held-out part (all but one conversation) scores the runs.
        f"+data.sources.held_out={{source: {held_out}, weight: 1.0, max_tokens: 0, max_epochs: null, val_size: {HELD_OUT}}}",
        f"train.global_batch_size={args.batch}", f"optim.lr={args.lr}", "scheduler=constant",
        "scheduler.warmup_steps=10", "train.eval_every=0", "trainer.enable_progress_bar=false",
        "logger=none", "~callbacks.plots", "callbacks.checkpoint.every_n_steps=0",
    ]  # fmt: skip
    if p is not None:
        overrides += ["+strategy/mixout=default", f"strategy.mixout.p={p}", f"strategy.mixout.seed={seed}"]
    history = fit_run(compose("sft", overrides), run_dir)
    return [h["val_loss"] for h in history if "val_loss" in h][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="champ", choices=("alpaca", "glaive", "humaneval", "champ", "ifbench"))
    parser.add_argument("--p", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=float, default=6.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--base-steps", type=int, default=2000, help="as in bench/msft.py")
    parser.add_argument("--base-stop", type=int, default=None, help="as in bench/msft.py")
    args = parser.parse_args()

    start = time.perf_counter()
    base = pretrained_base(args)
    finals: dict[str, list[float]] = {"plain": [], "mixout": []}
    with tempfile.TemporaryDirectory(prefix="plait-bench-mixout-") as tmp:
        held_out, train_files = write_split(args.source, args.seeds, Path(tmp))
        for seed in range(args.seeds):
            for arm, p in (("plain", None), ("mixout", args.p)):
                data = (held_out, train_files[seed])
                finals[arm].append(finetune(args, base, data, seed, p, Path(tmp) / f"{arm}_{seed}"))
                print(f"seed {seed} {arm}: final held-out loss {finals[arm][-1]:.4f}", flush=True)
    stats = {arm: (statistics.mean(v), statistics.stdev(v), statistics.variance(v)) for arm, v in finals.items()}
    print(
        f"\n{args.source}, {args.epochs} epochs at lr {args.lr}, {args.seeds} seeds, Mixout p={args.p}; "
        f"{time.perf_counter() - start:.0f} s"
    )
    print("| arm | final held-out loss per seed | mean | std | variance |")
    print("|---|---|---|---|---|")
    for arm, (mean, std, var) in stats.items():
        print(f"| {arm} | {', '.join(f'{x:.4f}' for x in finals[arm])} | {mean:.4f} | {std:.4f} | {var:.3e} |")
    (m_mean, _, m_var), (p_mean, _, p_var) = stats["mixout"], stats["plain"]
    print(
        f"RESULT mixout_var={m_var:.3e} plain_var={p_var:.3e} var_ratio={m_var / p_var:.3f} "
        f"mixout_mean={m_mean:.4f} plain_mean={p_mean:.4f}"
    )


if __name__ == "__main__":
    main()
