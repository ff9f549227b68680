"""The learning tier: every recipe the README offers trains a short run that must reach a held-out threshold.

Equality with one process shows that a layout computes the right numbers, not that a recipe
learns: plait's DPO check once fell from 0.965 to 0.566 held-out reward accuracy with every test
green (a preset cut the letters out of every prompt). So each recipe keeps an entry here: one short
run at a fixed seed on a task whose success can be read off (held-out reward accuracy, a
validation loss, a merged model's scores on both of its tasks), with a threshold set from measured
runs and a margin (`ENTRIES`). The same runs give the **golden curves**: each entry's first
`GOLDEN_STEPS` optimizer steps' training loss (and, for preference objectives, rewards: KTO's
``rewards/mismatched`` follows its KL rows even while the clamped KL estimate is 0), stored in
``tests/learns/golden.json`` and compared at a relative `GOLDEN_RTOL` (`tests/learns/test_learns.py`).

The tasks are synthetic and verifiable, small enough for two CPU cores:

- ``copy`` SFT (trainer.data.synthetic): "copy: k q z m" -> "k q z m"; the ``sft`` entry trains
  it from scratch and is the **base** the fine-tuning entries start from (``model.init_from``), as
  a real pipeline starts DPO from its SFT model;
- ``copy`` preference pairs (trainer.data.preference_sources, ``data=preference_synthetic``): the
  rejected answer has one letter the prompt does not contain. Held-out prompts are disjoint from
  the training ones, so held-out reward accuracy above chance means the rule was learnt. The
  preference entries start from the SFT base (and its BPE); ``dpo_preset`` trains the preset as
  the README runs it, from scratch on the preset's own BPE and lengths;
- ``reversal`` SFT: the fine-tuning entries' new skill (LoRA, QLoRA, Mixout, SAT from the base);
- ``reversal`` and ``sorting`` together: the mSFT search's two sources;
- the bundled corpus (Shakespeare + King James Bible) for the pretraining entries.

Every run goes through plait's real path in a process of its own: the recipe composed with the
entry's overrides (`trainer.compose.compose`), `trainer.build.build_run`, Lightning ``fit`` (the
fork launcher for two ranks), ``config.yaml``/``tokenizer.json`` written as a launch writes them;
measures are read back from the run's ``metrics.csv``.

Invocations (from the repository root)::

    python -m pytest tests/learns                     # the tier: one line per entry, value and threshold
    python tests/learns/tier.py                       # the same runs without pytest (prints a table)
    python tests/learns/tier.py --only sft,dpo        # some entries (and the entries they start from)
    python tests/learns/tier.py --update-golden       # rewrite golden.json (a change that moves numerics on purpose)

The last line of the script is ``RESULT passed=<n> failed=<names> wall_s=<s>``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden.json")
GOLDEN_STEPS = 8
# Relative tolerance of the golden curves. Runs at one thread on one CPU model repeat bit for bit;
# 1e-6 leaves room for a libm or kernel of another release without hiding a changed number.
GOLDEN_RTOL = 1e-6
GOLDEN_KEYS = (
    "train/loss", "train/rewards/accuracy", "train/rewards/margin", "train/rewards/chosen", "train/rewards/rejected",
    "train/rewards/mismatched", "train/kl",
)  # fmt: skip

# Every run: quiet, one evaluation at the start and one at the end, no plot.
COMMON = ("trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "train.eval_every=0", "~callbacks.plots", "seed=0")
NANO = ("model=nano", "model.max_seq_len=64")
# The copy SFT task alone, from the synthetic SFT preset (64-token rows: every sample fits whole).
COPY_SFT = (
    "data=synthetic", "~data.sources.reversal", "~data.sources.sorting", "~data.sources.addition",
    "+data.sources.copy={source: copy, limit: 2000, val_size: 64, max_epochs: 10}",
)  # fmt: skip
REVERSAL_SFT = (
    "data=synthetic", "~data.sources.sorting", "~data.sources.addition",
    "data.sources.reversal={source: reversal, limit: 1000, val_size: 64, max_epochs: 10}",
)  # fmt: skip
PAIRS = ("data=preference_synthetic", "data.sources.copy.limit=2000")
MSFT_DATA = (
    "data=synthetic", "~data.sources.addition", "data.sources.reversal.limit=300", "data.sources.sorting.limit=300",
    "data.sources.reversal.metric=loss", "data.sources.sorting.metric=loss",
)  # fmt: skip
TEXT = ("data.seq_len=64", "data.eval_rows=32")


# ------------------------------------------------------------------------------------------ measures
def final_val(key: str) -> Callable[[dict[str, Any]], float]:
    """The measure ``key`` of the run's last evaluation (a ``val/...`` column of metrics.csv)."""

    def read(result: dict[str, Any]) -> float:
        return result["evals"][-1][key]

    read.__doc__ = f"{key} at the last evaluation"
    read.__name__ = f"final_val({key!r})"
    return read


def kto_margin(result: dict[str, Any]) -> float:
    """held-out reward, desirable - undesirable rows

    KTO's rows are unpaired: no pairwise accuracy, the mean rewards of the two labels instead."""
    last = result["evals"][-1]
    return last["val/rewards/chosen"] - last["val/rewards/rejected"]


def margin_gain(result: dict[str, Any]) -> float:
    """held-out reward margin (chosen - rejected) gained

    A reference-free objective's rewards are the policy's own, so a base that already prefers the
    chosen answers starts above 0: the run must widen the margin."""
    first, last = result["evals"][0], result["evals"][-1]
    return last["val/rewards/margin"] - first["val/rewards/margin"]


def msft_final_loss(result: dict[str, Any]) -> float:
    """mean held-out loss of the sources at the search's result (msft.json)"""
    return -result["msft"]["final_mean"]


def merged_scores(result: dict[str, Any]) -> float:
    """merged model's gain over its base on both tasks, the smaller, in units of each arm's

    On copy SFT: (held-out loss of the base - the merged) / (the base - the SFT arm); on copy pairs:
    (held-out reward accuracy of the merged against the base - 0.5) / (the DPO arm's - 0.5)."""
    return min(result["merge"]["sft_gain"], result["merge"]["dpo_gain"])


@dataclass(frozen=True)
class Entry:
    """One recipe of the tier.

    Args:
        recipe: the bundled recipe (``pretrain``, ``sft``, ``dpo`` ...).
        overrides: Hydra overrides after `COMMON`.
        measure: reads the success measure off the run (`final_val`, `kto_margin`, ...).
        threshold: the value the measure must reach, set from measured runs with a margin.
        lower_is_better: a loss (``measure <= threshold``) rather than a score (``>=``).
        base: the entry whose run this one starts from (``model.init_from``).
        devices: processes (2: a layout that needs two ranks).
        merge: PAFT: the two arm entries whose deltas are merged into ``base``.
    """

    recipe: str
    overrides: tuple[str, ...]
    measure: Callable[[dict[str, Any]], float]
    threshold: float
    lower_is_better: bool = False
    base: str | None = None
    devices: int = 1
    merge: tuple[str, ...] = field(default=())

    @property
    def describes(self) -> str:
        return (self.measure.__doc__ or self.measure.__name__).strip().split("\n")[0]


def _preference(objective: str, *extra: str) -> tuple[str, ...]:
    return (*PAIRS, f"objective={objective}", "train.global_batch_size=32", "optim.lr=1e-3", "scheduler=constant",
            "scheduler.warmup_steps=5", "trainer.max_steps=60", *extra)  # fmt: skip


def _finetune(*extra: str) -> tuple[str, ...]:
    return (*REVERSAL_SFT, "train.global_batch_size=32", "optim.lr=3e-3", "scheduler=constant", "scheduler.warmup_steps=5",
            "trainer.max_steps=60", *extra)  # fmt: skip


MOE = (
    "model=moe_tiny", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "model.num_experts=4", "model.top_k=2", "model.moe_ffn_dim=64", "model.n_dense_layers=0", "model.max_seq_len=64",
)  # fmt: skip
PRETRAIN = (*TEXT, "trainer.max_steps=80", "optim.lr=3e-3")

ENTRIES: dict[str, Entry] = {
    # The README's verifiable-pairs DPO (plait dpo data=preference_synthetic model=nano
    # objective.beta=1.0) from scratch, on the preset's own BPE and lengths, as bench/dpo.py runs it
    # for 2000 steps: a preset that cuts the prompts (83bde6a) leaves it at chance.
    "dpo_preset": Entry(
        "dpo", ("model=nano", "data=preference_synthetic", "data.sources.copy.limit=4000", "data.sources.copy.val_size=256",
                "objective.beta=1.0", "train.global_batch_size=32", "optim.lr=3e-3", "scheduler=constant",
                "scheduler.warmup_steps=20", "trainer.max_steps=350"),
        final_val("val/rewards/accuracy"), 0.8,
    ),  # fmt: skip
    # Chat SFT (default template, loss on the assistant tokens only) from scratch: the base below.
    "sft": Entry(
        "sft", (*NANO, *COPY_SFT, "train.global_batch_size=32", "optim.lr=3e-3", "scheduler=constant", "scheduler.warmup_steps=10",
                "trainer.max_steps=250"),
        final_val("val/loss"), 1.5, lower_is_better=True,
    ),  # fmt: skip
    # Preference objectives from the SFT base on copy pairs.
    "dpo": Entry("dpo", _preference("dpo", "objective.beta=1.0"), final_val("val/rewards/accuracy"), 0.75, base="sft"),
    "ipo": Entry("ipo", _preference("ipo"), final_val("val/rewards/accuracy"), 0.7, base="sft"),
    "simpo": Entry("simpo", _preference("simpo"), margin_gain, 0.4, base="sft"),
    "orpo": Entry("orpo", _preference("orpo"), margin_gain, 0.015, base="sft"),
    "kto": Entry("kto", _preference("kto"), kto_margin, 0.08, base="sft"),
    # Fine-tunes of the SFT base on a new task (reversal).
    "lora_sft": Entry("sft", _finetune("+strategy/lora=default"), final_val("val/loss"), 1.5, lower_is_better=True, base="sft"),
    "qlora_sft": Entry(
        "sft", _finetune("+strategy/lora=default", "strategy.lora.quantize=nf4"), final_val("val/loss"), 1.5,
        lower_is_better=True, base="sft",
    ),  # fmt: skip
    "mixout_sft": Entry("sft", _finetune("+strategy/mixout=default"), final_val("val/loss"), 1.5, lower_is_better=True, base="sft"),
    "sat_sft": Entry("sft", _finetune("+strategy/sat=default"), final_val("val/loss"), 1.5, lower_is_better=True, base="sft"),
    # PAFT: its SFT arm (more copy SFT, L1 on the delta) and its DPO arm (the dpo entry: the paft
    # recipe with paft=dpo composes the same run) from the SFT base, then their TIES merge into
    # the base, scored on both arms' held-out data. (An SFT arm on another task, reversal or
    # sorting, makes the base forget copying, and the merge then undoes the DPO arm's gain.)
    "paft_sft": Entry("paft", ("paft=sft", *_finetune()[len(REVERSAL_SFT):], *COPY_SFT), final_val("val/loss"), 1.0,
                      lower_is_better=True, base="sft"),  # fmt: skip
    "paft_merge": Entry("merge", ("method=ties",), merged_scores, 0.3, base="sft", merge=("paft_sft", "dpo")),
    # Pretraining on the bundled corpus: held-out loss from ln(4096) = 8.32.
    "pretrain": Entry("pretrain", (*NANO, *PRETRAIN), final_val("val/loss"), 6.5, lower_is_better=True),
    "moe_ep": Entry("pretrain", (*MOE, *PRETRAIN, "strategy=nd", "strategy.expert_parallel.ep=2"), final_val("val/loss"), 6.5,
                    lower_is_better=True, devices=2),  # fmt: skip
    "diloco": Entry("pretrain", (*NANO, *PRETRAIN, "strategy=diloco", "strategy.local_sgd.sync_every=10"), final_val("val/loss"), 6.5,
                    lower_is_better=True, devices=2),  # fmt: skip
    "desloc": Entry(
        "pretrain", (*NANO, *PRETRAIN, "strategy=desloc", "strategy.local_sgd.param_every=4", "strategy.local_sgd.exp_avg_every=8",
                     "strategy.local_sgd.exp_avg_sq_every=16"),
        final_val("val/loss"), 6.5, lower_is_better=True, devices=2,
    ),  # fmt: skip
    # The mSFT budget search on two synthetic sources, from the SFT base.
    "msft": Entry(
        "sft", (*MSFT_DATA, "budget=msft", "budget.compute=1.0", "budget.eval_every=10", "budget.patience=2", "budget.baseline=false",
                "train.global_batch_size=32", "optim.lr=3e-3", "scheduler=constant", "scheduler.warmup_steps=5"),
        msft_final_loss, 3.0, lower_is_better=True, base="sft",
    ),  # fmt: skip
}


# ------------------------------------------------------------------------------------------ runs
def _read_metrics(run_dir: Path) -> tuple[list[dict[str, float]], dict[int, dict[str, float]]]:
    """(evaluations, training rows by step) of a run's metrics.csv, as floats."""
    evals, steps = [], {}
    with open(run_dir / "metrics.csv", newline="") as file:
        for row in csv.DictReader(file):
            values = {k: float(v) for k, v in row.items() if v not in (None, "")}
            if "val/loss" in values:
                evals.append(values)
            if "train/loss" in values:
                steps[int(values["step"])] = values
    return evals, steps


def compose_entry(name: str, run_dir: Path, base_dir: Path | None) -> Any:
    """The composed config of entry ``name``, writing to ``run_dir``."""
    from trainer.compose import compose

    entry = ENTRIES[name]
    overrides = [*COMMON, *entry.overrides, f"run_dir={run_dir}", f"trainer.devices={entry.devices}"]
    if base_dir is not None:
        overrides.append(f"model.init_from={base_dir}")
    return compose(entry.recipe, overrides)


def train(cfg: Any, run_dir: Path, devices: int) -> None:
    """Fits ``cfg`` as ``plait`` does after its checks: `build_run`, the run record (``config.yaml``
    and ``tokenizer.json``, which ``model.init_from`` reads), Lightning ``fit``."""
    from trainer.build import build_run
    from trainer.resume import ResumeRecord

    trainer, task, data = build_run(cfg, run_dir, launcher="fork" if devices > 1 else "subprocess")
    trainer.callbacks.append(ResumeRecord(cfg, data.tokenizer, run_dir, {}))
    trainer.fit(task, datamodule=data)


def _logps(model: Any, rows: dict[str, Any], micro_batch_size: int = 64) -> tuple[Any, Any]:
    """Summed target log-probs and target counts of each ``[N, T]`` row (`sequence_logps`)."""
    import torch

    from trainer.objectives.preference import sequence_logps

    logps, counts = [], []
    with torch.no_grad():
        for i in range(0, len(rows["input_ids"]), micro_batch_size):
            part = {k: v[i : i + micro_batch_size] for k, v in rows.items()}
            logits = model(part["input_ids"], position_ids_bt=part["position_ids"], document_ids_bt=part["document_ids"])
            lp, n = sequence_logps(logits, part["labels"])
            logps.append(lp)
            counts.append(n)
    return torch.cat(logps), torch.cat(counts)


def merge_and_score(name: str, work: Path) -> dict[str, float]:
    """PAFT's merge (``plait merge``) of the entry's two arms into its base, and the merged model
    scored on both arms' held-out data: the SFT arm's loss per token, and reward accuracy on copy pairs
    against the base as the reference (what the DPO arm's own evaluation measures)."""
    from trainer.build import build_data
    from trainer.merge import main as merge
    from trainer.rundir import load_run_model

    entry = ENTRIES[name]
    base, (sft_arm, dpo_arm), out = work / str(entry.base), entry.merge, work / name
    merge([f"base={base}", f"deltas=[{work / sft_arm},{work / dpo_arm}]", *entry.overrides, f"out={out}"])
    models = {key: load_run_model(path).model for key, path in (("base", base), ("merged", out), ("sft_arm", work / sft_arm))}
    sft_rows = build_data(compose_entry(sft_arm, out / "unused", base)).eval_rows()
    nll = {}
    for key, model in models.items():
        logps, counts = _logps(model, sft_rows)
        nll[key] = float(-logps.sum() / counts.sum())
    pairs = {k: v.flatten(0, 1) for k, v in build_data(compose_entry(dpo_arm, out / "unused", base)).pairs("val").items()}
    ratio = (_logps(models["merged"], pairs)[0] - _logps(models["base"], pairs)[0]).view(-1, 2)
    accuracy = float(((ratio[:, 0] > ratio[:, 1]).float() + 0.5 * (ratio[:, 0] == ratio[:, 1]).float()).mean())
    arm_accuracy = json.loads((work / f"{dpo_arm}.json").read_text())["value"]
    return {
        "nll_base": nll["base"], "nll_merged": nll["merged"], "nll_sft_arm": nll["sft_arm"],
        "accuracy_merged": accuracy, "accuracy_dpo_arm": arm_accuracy,
        "sft_gain": (nll["base"] - nll["merged"]) / (nll["base"] - nll["sft_arm"]),
        "dpo_gain": (accuracy - 0.5) / (arm_accuracy - 0.5),
    }  # fmt: skip


def run_entry(name: str, work: Path) -> dict[str, Any]:
    """Trains entry ``name`` under ``work/<name>`` (its base's run at ``work/<base>``) and returns
    its measure, evaluations and first training steps."""
    import torch

    torch.set_num_threads(1)  # the golden curves are one-thread numbers; two entries share two cores
    entry = ENTRIES[name]
    run_dir = work / name
    start = time.perf_counter()
    result: dict[str, Any] = {"evals": [], "curve": {}}
    if entry.merge:
        result["merge"] = merge_and_score(name, work)
    else:
        cfg = compose_entry(name, run_dir, work / entry.base if entry.base else None)
        if cfg.get("budget") is not None:  # a budget search drives its own runs (the first one's curve is kept)
            from hydra.utils import instantiate

            result["msft"] = instantiate(cfg.budget).run(cfg, run_dir)
            metrics_dir = run_dir / "rollout_0"
        else:
            train(cfg, run_dir, entry.devices)
            metrics_dir = run_dir
        evals, steps = _read_metrics(metrics_dir)
        curve = {key: [steps[s][key] for s in range(1, GOLDEN_STEPS + 1) if key in steps.get(s, {})] for key in GOLDEN_KEYS}
        result.update(evals=evals, curve={k: v for k, v in curve.items() if v})
    result["value"] = entry.measure(result)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def _worker(name: str, work: Path, out: Path) -> None:
    try:
        result = run_entry(name, work)
    except BaseException:  # noqa: BLE001 - reported to the driver, which fails the entry
        result = {"error": traceback.format_exc()[-4000:]}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    os._exit(0)  # before gloo's exit-time threads can abort the process (results are on disk)


def needed(names: list[str]) -> list[str]:
    """``names`` and every entry they start from, bases first."""
    order: list[str] = []

    def visit(name: str) -> None:
        entry = ENTRIES[name]
        for dep in (entry.base, *entry.merge):
            if dep is not None and dep not in order:
                visit(dep)
        if name not in order:
            order.append(name)

    for name in names:
        visit(name)
    return order


def run_tier(
    names: list[str], work: Path, *, jobs: int = 2, timeout_s: float = 900, reuse: bool = False
) -> dict[str, dict[str, Any]]:
    """Runs ``names`` (and their bases), ``jobs`` at a time in forked processes; returns each
    entry's result (``{"error": ...}`` for a run that failed or started from one that did).
    ``reuse``: a base (an entry not in ``names``) whose result is already in ``work`` is not run again."""
    ctx = multiprocessing.get_context("fork")
    import trainer.build  # noqa: F401 - imported once here: the forked workers inherit it
    todo, running, results = needed(names), {}, {}
    for name in [n for n in todo if n not in names] if reuse else ():
        if (work / f"{name}.json").exists() and "error" not in (found := json.loads((work / f"{name}.json").read_text())):
            todo.remove(name)
            results[name] = found
    deadline = time.monotonic() + timeout_s
    while todo or running:
        for name in list(todo):
            if len(running) >= jobs:
                break
            entry = ENTRIES[name]
            deps = [d for d in (entry.base, *entry.merge) if d is not None]
            if any(d in todo or d in running for d in deps):
                continue
            todo.remove(name)
            if failed := [d for d in deps if "error" in results[d]]:
                results[name] = {"error": f"not run: {', '.join(failed)} failed"}
                continue
            out = work / f"{name}.json"
            out.unlink(missing_ok=True)
            process = ctx.Process(target=_worker, args=(name, work, out))
            process.start()
            running[name] = (process, out)
        time.sleep(0.2)
        for name, (process, out) in list(running.items()):
            if out.exists() or not process.is_alive() or time.monotonic() > deadline:
                process.join(timeout=5 if out.exists() else 0)
                if process.is_alive():
                    process.kill()
                results[name] = json.loads(out.read_text()) if out.exists() else {"error": f"exit {process.exitcode}, no result"}
                del running[name]
    return results


def passed(name: str, result: dict[str, Any]) -> bool:
    entry = ENTRIES[name]
    if "value" not in result or not math.isfinite(result["value"]):
        return False
    return result["value"] <= entry.threshold if entry.lower_is_better else result["value"] >= entry.threshold


def line(name: str, result: dict[str, Any]) -> str:
    """``learns: dpo  0.953 >= 0.800  val/rewards/accuracy at the last evaluation  (12.3 s)``."""
    entry = ENTRIES[name]
    if "value" not in result:
        return f"learns: {name:<11} ERROR  {result.get('error', '').strip().splitlines()[-1] if result.get('error') else ''}"
    sign = "<=" if entry.lower_is_better else ">="
    verdict = "ok" if passed(name, result) else "FAILED"
    return f"learns: {name:<11} {result['value']:.4f} {sign} {entry.threshold:<6g} {verdict:<6}  {entry.describes}  ({result['wall_s']} s)"


def golden_curves() -> dict[str, dict[str, list[float]]]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def curve_mismatch(stored: dict[str, list[float]], curve: dict[str, list[float]], rtol: float = GOLDEN_RTOL) -> list[str]:
    """Where ``curve`` differs from ``stored`` by more than ``rtol`` (relative; an absolute floor of
    ``rtol`` for values near 0), one line per key."""
    problems = []
    for key in sorted(set(stored) | set(curve)):
        a, b = stored.get(key), curve.get(key)
        if a is None or b is None or len(a) != len(b):
            problems.append(f"{key}: stored {a} vs now {b}")
            continue
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not abs(x - y) <= rtol * max(abs(x), abs(y), 1.0)]
        if bad:
            i = bad[0]
            problems.append(f"{key}: step {i + 1} stored {a[i]!r} now {b[i]!r} ({len(bad)} of {len(a)} steps differ)")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated entries (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="entries trained at once (one thread each)")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--update-golden", action="store_true", help="write the runs' curves to tests/learns/golden.json")
    parser.add_argument("--json", type=Path, default=None, help="also write every result here")
    parser.add_argument("--reuse", action="store_true", help="keep the results already in --work (calibration)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ENTRIES)
    if unknown := sorted(set(names) - set(ENTRIES)):
        parser.error(f"unknown entries {unknown}; known: {', '.join(ENTRIES)}")
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plait-learns-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = run_tier(names, work, jobs=args.jobs, reuse=args.reuse)
    for name, result in results.items():
        print(line(name, result))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.update_golden:
        stored = golden_curves()
        stored.update({name: r["curve"] for name, r in results.items() if r.get("curve")})
        GOLDEN.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")
        print(f"golden curves of {len(results)} entries written to {GOLDEN.relative_to(ROOT)}")
    failed = [name for name, r in results.items() if not passed(name, r)]
    print(f"RESULT passed={len(results) - len(failed)} failed={','.join(failed) or '-'} wall_s={time.perf_counter() - start:.0f}")


if __name__ == "__main__":
    main()
