"""The combination matrix: every recipe x strategy preset x step-changing option (objective options, compile).

Each combination either fails `trainer.config.validate` (before any process or directory; its
messages go into the table) or trains 2 steps on a tiny model in forked gloo ranks with the same
history as the one-process run of the same recipe and options: every train/val key the one-process
run logs (per-source losses, preference rewards, exact match) is logged, each value within 1e-5
absolute + 1e-5 relative.

A combination is ``(recipe, strategy, option)``; `RECIPES` and `OPTIONS` give their overrides,
`STRATEGIES` the layout's overrides (trainer.devices included). The SGD of `harness.EXACT_SGD`
(constant LR, no clipping) makes the second step's loss a function of the first step's gradient
only, so layouts that reduce gradients in another order still agree to 1e-5. Local-SGD presets
synchronise after every step with an outer SGD of lr 1 and no momentum: averaging the islands'
SGD steps is then the step on the global gradient (equal token counts per island), so they too
equal one process (their own equivalence at H > 1 is tests/dist/test_local_sgd.py's).

Run the whole matrix and print the result table::

    python tests/matrix.py [--only SUBSTRING,...] > matrix.md
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

if __name__ == "__main__":
    # Before torch loads OpenMP (the harness imports it): set later, the parent's GEMMs ran on an
    # OpenMP pool, and a rank forked after them hung in its first GEMM (libgomp is not fork-safe).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:  # run as a script
    sys.path.insert(0, str(_TESTS))

from harness import EXACT_SGD, compose_config  # noqa: E402

TOL = 1e-5
STEPS = 2
_COMMON = (
    *EXACT_SGD,
    f"trainer.max_steps={STEPS}",
    "train.micro_batch_size=null",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "strategy.timeout_s=120",
    "logger=none",
    "~callbacks.plots",
    "~callbacks.checkpoint",
    "model=nano",
)
_SFT_DATA = (
    "+model.vocab_size=288",
    "data=synthetic",
    "data.seq_len=48",
    "data.sources.addition.limit=24",
    "data.sources.addition.val_size=4",
    "data.sources.sorting.limit=24",
    "data.sources.sorting.val_size=4",
    "~data.sources.reversal",
)
_PREFERENCE_DATA = (
    "+model.vocab_size=288",
    "data=preference_synthetic",
    "data.seq_len=24",
    "data.max_prompt_len=12",
    "data.sources.copy.limit=24",
    "data.sources.copy.val_size=4",
    "optim.lr=0.5",
)
_METRIC_LOSS = ("data.sources.addition.metric=loss", "data.sources.sorting.metric=loss")

# recipe id -> (recipe, overrides)
RECIPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pretrain": ("pretrain", ("data.seq_len=32", "data.eval_rows=8")),
    "sft": ("sft", (*_SFT_DATA, *_METRIC_LOSS)),
    "dpo": ("dpo", _PREFERENCE_DATA),
    "ipo": ("ipo", _PREFERENCE_DATA),
    "simpo": ("simpo", _PREFERENCE_DATA),
    "orpo": ("orpo", _PREFERENCE_DATA),
    "kto": ("kto", _PREFERENCE_DATA),
    "paft_sft": ("paft", (*_SFT_DATA, *_METRIC_LOSS, "callbacks.delta_l1.strength=1e-2")),
    "paft_dpo": ("paft", ("paft=dpo", *_PREFERENCE_DATA)),
}
# option id -> (recipes it applies to, overrides). "base" is each recipe as composed (SFT: per-source losses).
OPTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "base": (tuple(RECIPES), ()),
    "chunked": (tuple(RECIPES), ("++objective.loss_chunk_tokens=16",)),
    "exact_match": (("sft", "paft_sft"), ("data.sources.addition.metric=exact_match",)),
    # Compiled blocks, traced by aot_eager (inductor's C++ build per graph is too slow for a matrix).
    "compile": (tuple(RECIPES), ("strategy.compile.enabled=true", "strategy.compile.backend=aot_eager")),
}
_SYNC_EVERY_STEP = (
    "strategy.local_sgd.outer_optimizer.lr=1.0",
    "strategy.local_sgd.outer_optimizer.momentum=0.0",
    "strategy.local_sgd.outer_optimizer.nesterov=false",
)
_LAYERS4 = ("model.n_layers=4",)  # two stages per rank for the interleaved and V schedules
_ADAM = ("optim=adamw", "optim.weight_decay=0.0")  # DES-LOC averages Adam's moments
# Strategy overrides that the one-process reference shares (the model and the optimizer).
_SHARED = ("model.", "optim")
# Local-SGD layouts: each island's gradient is the mean over its own tokens and the islands are
# averaged uniformly, which equals one process only when the islands' supervised-token counts are
# equal (not so for SFT rows), and averaging Adam steps (DES-LOC) is not Adam on the averaged
# gradient. Their step 1 and the evaluation before it are compared (the reported gradient norm
# is island 0's); every later value is finite and every key is there.
ISLANDS = ("diloco2", "streaming_diloco2", "desloc2", "local_adam2", "hierarchical2x2")
# strategy id -> overrides (a 4-layer model where a schedule needs 4 stages)
STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp2": ("strategy=ddp", "trainer.devices=2"),
    "fsdp2": ("strategy=fsdp", "trainer.devices=2"),
    "hsdp2x2": ("strategy=hsdp", "trainer.devices=4"),
    "tp2": ("strategy=tp", "trainer.devices=2"),
    "tp2_nosp": ("strategy=tp", "trainer.devices=2", "strategy.tensor_parallel.sequence_parallel=false"),
    "fsdp2_tp2": ("strategy=fsdp_tp", "trainer.devices=4"),
    **{
        f"pp2_{schedule}": ("strategy=pp", "trainer.devices=2", f"strategy.pipeline.schedule={schedule}", *layers)
        for schedule, layers in (
            ("GPipe", ()), ("1F1B", ()), ("Interleaved1F1B", _LAYERS4), ("InterleavedZeroBubble", _LAYERS4),
            ("ZBV", _LAYERS4), ("DualPipeV", _LAYERS4),
        )
    },
    "cp2_ring": ("strategy=cp", "trainer.devices=2", "strategy.context_parallel.mode=ring"),
    "cp2_ulysses": ("strategy=cp", "trainer.devices=2", "strategy.context_parallel.mode=ulysses"),
    "cp4_hybrid": ("strategy=cp", "trainer.devices=4", "strategy.context_parallel.mode=hybrid"),
    "fsdp2_cp2": ("strategy=nd", "strategy.dp_shard=2", "strategy.cp=2", "trainer.devices=4"),
    "fsdp2_pp2": ("strategy=nd", "strategy.dp_shard=2", "strategy.pp=2", "trainer.devices=4"),
    "pp2_tp2": ("strategy=nd", "strategy.dp_shard=1", "strategy.pp=2", "strategy.tp=2", "trainer.devices=4"),
    "cp2_tp2": ("strategy=nd", "strategy.dp_shard=1", "strategy.cp=2", "strategy.tp=2", "trainer.devices=4"),
    "diloco2": ("strategy=diloco", "trainer.devices=2", "strategy.local_sgd.sync_every=1", *_SYNC_EVERY_STEP),
    "streaming_diloco2": (
        "strategy=streaming_diloco", "trainer.devices=2", "strategy.local_sgd.sync_every=1", *_SYNC_EVERY_STEP,
        "strategy.local_sgd.num_fragments=1",
    ),
    "desloc2": ("strategy=desloc", "trainer.devices=2", *_ADAM, "strategy.local_sgd.param_every=1",
                "strategy.local_sgd.exp_avg_every=1", "strategy.local_sgd.exp_avg_sq_every=1"),
    "local_adam2": ("strategy=local_adam", "trainer.devices=2", *_ADAM, "strategy.local_sgd.param_every=1",
                    "strategy.local_sgd.exp_avg_every=1", "strategy.local_sgd.exp_avg_sq_every=1"),
    "hierarchical2x2": ("strategy=hierarchical", "trainer.devices=4", "strategy.local_sgd.sync_every=1"),
}  # fmt: skip


@dataclass(frozen=True)
class Combo:
    recipe: str
    strategy: str
    option: str

    @property
    def id(self) -> str:
        return f"{self.recipe}-{self.strategy}-{self.option}"

    def overrides(self) -> list[str]:
        return [*self.reference_overrides(), *(o for o in STRATEGIES[self.strategy] if not o.startswith(_SHARED))]

    def reference_overrides(self) -> list[str]:
        """The one-process run of the same recipe, option and model."""
        shared = [o for o in STRATEGIES[self.strategy] if o.startswith(_SHARED)]
        return [*_COMMON, *RECIPES[self.recipe][1], *OPTIONS[self.option][1], *shared]

    def config(self, reference: bool = False) -> DictConfig:
        return compose_config(
            self.reference_overrides() if reference else self.overrides(), recipe=RECIPES[self.recipe][0], tiny=False
        )


def combos() -> list[Combo]:
    return [
        Combo(recipe, strategy, option)
        for recipe in RECIPES
        for option, (recipes, _) in OPTIONS.items()
        if recipe in recipes
        for strategy in STRATEGIES
    ]


# The fast subset (default suite): one combination per failure the matrix found, on the cheapest
# layouts, with the outcome each must have.
FAST = {
    "pretrain-pp2_1F1B-chunked": "equal",  # the last stage's stand-in model had no LM head
    "sft-pp2_1F1B-base": "equal",  # per-source losses were lost under pp (and counted twice)
    "sft-tp2-base": "equal",  # SFT's per-token loss mixed a DTensor with tensors under loss parallel
    "sft-tp2_nosp-exact_match": "equal",  # greedy decoding took the argmax of sharded logits
    "sft-tp2-exact_match": "refused",  # decoding under sequence parallelism
    "sft-pp2_1F1B-exact_match": "refused",  # decoding on one pipeline stage
    "sft-cp2_ring-exact_match": "refused",  # decoding a sequence no cp rank shards
    "dpo-pp2_1F1B-base": "refused",
    "pretrain-pp2_ZBV-compile": "refused",  # crashed in the first backward (compiled blocks, split backward)
}


def _history(cfg: DictConfig, run: Any, run_dir: Path) -> list[dict[str, Any]]:
    import os

    from strategies.runtime.launch import LAUNCH_ENV
    from trainer.build import build_run

    trainer, task, data = build_run(cfg, run_dir, run, launcher="fork")
    try:
        trainer.fit(task, datamodule=data)
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
    return task.history


def flat(history: list[dict[str, Any]]) -> dict[str, float]:
    """``{"<step>:<key>": value}`` of a Task history: train entries (loss, grad_norm, metrics) and
    evaluations (val_loss and their metrics). Local-SGD byte counts are the layout's own."""
    out: dict[str, float] = {}
    for entry in history:
        step = entry.get("step")
        for key, value in {**entry, **entry.get("metrics", {})}.items():
            if key in ("step", "metrics", "params", "grads") or key.startswith("comm/"):
                continue
            kind = "val" if "val_loss" in entry else "train"
            out[f"{step}:{kind}:{key}"] = float(value)
    return out


def differences(got: dict[str, float], want: dict[str, float]) -> list[str]:
    """What ``got`` lacks, adds or gets wrong (beyond `TOL` absolute + `TOL` relative; the gradient
    norm to 1e-4 relative)."""
    problems = [f"missing {k}" for k in want if k not in got] + [f"extra {k}" for k in got if k not in want]
    for key in want.keys() & got.keys():
        # rtol + atol as test_preference_equivalence (IPO's squared losses are ~30 after 2 steps).
        tol = 1e-4 * abs(want[key]) if key.endswith("grad_norm") else TOL + TOL * abs(want[key])
        if not (abs(got[key] - want[key]) <= tol or (math.isnan(got[key]) and math.isnan(want[key]))):
            problems.append(f"{key}: {got[key]:.8g} != {want[key]:.8g}")
    return sorted(problems)


_REFERENCES: dict[tuple[str, ...], dict[str, float]] = {}  # (recipe, *overrides) -> history


def reference(combo: Combo) -> dict[str, float]:
    """The one-process history of ``combo``'s recipe and option (cached per config)."""
    from trainer.config import validate

    key = (RECIPES[combo.recipe][0], *combo.reference_overrides())
    if key not in _REFERENCES:
        cfg = combo.config(reference=True)
        with tempfile.TemporaryDirectory() as tmp:
            _REFERENCES[key] = flat(_history(cfg, validate(cfg), Path(tmp)))
    return _REFERENCES[key]


@dataclass
class Outcome:
    combo: Combo
    kind: str  # "equal", "refused", "different", "crash"
    detail: str = ""


def check(combo: Combo) -> Outcome:
    """Validates ``combo``; if accepted, trains it and compares with one process."""
    from trainer.config import ConfigError, validate

    cfg = combo.config()
    try:
        run = validate(cfg)
    except ConfigError as err:
        return Outcome(combo, "refused", " / ".join(err.problems))
    try:
        want = reference(combo)
        with tempfile.TemporaryDirectory() as tmp:
            got = flat(_history(cfg, run, Path(tmp)))
    except Exception as err:  # noqa: BLE001 - a crash after validate accepted is the outcome
        return Outcome(combo, "crash", "".join(traceback.format_exception_only(err)).strip()[-600:])
    if combo.strategy in ISLANDS:
        later = [k for k in want if int(k.split(":")[0]) > 1 or k.endswith("grad_norm")]
        problems = [f"{k} not finite" for k in later if not math.isfinite(got.get(k, math.nan))]
        problems += differences(
            {k: v for k, v in got.items() if k not in later}, {k: v for k, v in want.items() if k not in later}
        )
    else:
        problems = differences(got, want)
    return Outcome(combo, "different" if problems else "equal", "; ".join(problems[:6]))


def main(argv: list[str]) -> int:
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else [""]
    outcomes = []
    for combo in combos():
        if any(part in combo.id for part in only):
            outcomes.append(check(combo))
            print(f"{outcomes[-1].kind:9} {combo.id} {outcomes[-1].detail[:300]}", file=sys.stderr, flush=True)
    counts = {k: sum(o.kind == k for o in outcomes) for k in ("equal", "refused", "different", "crash")}
    print(f"RESULT combinations={len(outcomes)} " + " ".join(f"{k}={v}" for k, v in counts.items()))
    print("\n| combination | outcome | message |\n|---|---|---|")
    for o in outcomes:
        if o.kind != "equal":
            print(f"| {o.combo.id} | {o.kind} | {o.detail.replace('|', '/')} |")
    return 0 if counts["different"] == counts["crash"] == 0 else 1


if __name__ == "__main__":
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    raise SystemExit(main(sys.argv[1:]))
