"""The learning tier: every recipe the README offers trains a short run that must reach a held-out threshold.

Equality with one process shows that a layout computes the right numbers, not that a recipe
learns: plait's DPO check once fell from 0.965 to 0.566 held-out reward accuracy with every test
green (a preset cut the letters out of every prompt). So each recipe keeps an entry here: one short
run at a fixed seed on a task whose success can be read off (held-out reward accuracy, a
validation loss, a merged model's scores on both of its tasks), with a threshold set from measured
runs and a margin (tests/learns/entries.py). The same runs give the **golden curves**: each entry's first
`GOLDEN_STEPS` optimizer steps' training loss (and, for preference objectives, rewards: KTO's
``rewards/mismatched`` follows its KL rows even while the clamped KL estimate is 0), stored in
``tests/learns/golden.json`` and compared at a relative `GOLDEN_RTOL` (`tests/learns/test_learns.py`).

The entries, their tasks and checks are in tests/learns/entries.py; this module runs them.

Every run goes through plait's real path in a process of its own: the recipe composed with the
entry's overrides (`trainer.compose.compose`), `trainer.build.build_run`, Lightning ``fit`` (the
fork launcher for two ranks), ``config.yaml``/``tokenizer.json`` written as a launch writes them;
measures are read back from the run's ``metrics.csv``.

Invocations (from the repository root)::

    python -m pytest tests/learns                     # the tier: one line per entry, value and threshold
    python tests/learns/tier.py                       # the same runs without pytest (prints a table)
    python tests/learns/tier.py --only sft,dpo        # some entries (and the entries they start from)
    python tests/learns/tier.py --update-golden       # rewrite golden.json (a change that moves numerics on purpose)

The last line of the script is ``RESULT passed=<n> failed=<names> wall_s=<s>``; it exits 1 when an
entry failed (and ``--update-golden`` then rewrites only the entries that passed).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: tests/ on the path, as pytest has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learns.checks import Result
from learns.entries import ENTRIES, passed
from learns.golden import GOLDEN_KEYS, GOLDEN_STEPS, golden_line, update_golden

ROOT = Path(__file__).resolve().parents[2]
# Every run: quiet, every step logged (the golden curves), one evaluation at the start and one at the end.
COMMON = (
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "train.eval_every=0",
    "~callbacks.plots",
    "seed=0",
)
# Variables a launcher around this script may have set; each run's ranks pick their own port.
LAUNCH_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


# ------------------------------------------------------------------------------------------ one run
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
    from trainer.resume_record import ResumeRecord

    trainer, task, data = build_run(cfg, run_dir, launcher="fork" if devices > 1 else "subprocess")
    trainer.callbacks.append(ResumeRecord(cfg, data.tokenizer, run_dir, {}))
    trainer.fit(task, datamodule=data)


def _logps(model: Any, rows: dict[str, Any], micro_batch_size: int = 64) -> tuple[Any, Any]:
    """Summed target log-probs and target counts of each ``[N, T]`` row (`sequence_logps`)."""
    import torch

    from trainer.objectives.pair_losses import sequence_logps

    logps, counts = [], []
    with torch.no_grad():
        for i in range(0, len(rows["input_ids"]), micro_batch_size):
            part = {k: v[i : i + micro_batch_size] for k, v in rows.items()}
            logits = model(
                part["input_ids"], position_ids_bt=part["position_ids"], document_ids_bt=part["document_ids"]
            )
            lp, n = sequence_logps(logits, part["labels"])
            logps.append(lp)
            counts.append(n)
    return torch.cat(logps), torch.cat(counts)


def merge_and_score(name: str, work: Path) -> dict[str, float]:
    """PAFT's merge (``plait merge``) of the entry's two arms into its base, and the merged model
    scored on both arms' held-out data: the SFT arm's loss per token, and reward accuracy on copy
    pairs against the base as the reference (what the DPO arm's own evaluation measures)."""
    from trainer.build import build_data
    from trainer.merge import main as merge
    from trainer.merge import sparsity
    from trainer.run_model import load_run_model

    entry = ENTRIES[name]
    base, (sft_arm, dpo_arm), out = work / str(entry.base), entry.merge, work / name
    merge([f"base={base}", f"deltas=[{work / sft_arm},{work / dpo_arm}]", *entry.overrides, f"out={out}"])
    models = {
        key: load_run_model(path).model for key, path in (("base", base), ("merged", out), ("sft_arm", work / sft_arm))
    }
    sft_rows = build_data(compose_entry(sft_arm, out / "unused", base)).eval_rows()
    nll = {}
    for key, model in models.items():
        logps, counts = _logps(model, sft_rows)
        nll[key] = float(-logps.sum() / counts.sum())
    pairs = {
        k: v.flatten(0, 1) for k, v in build_data(compose_entry(dpo_arm, out / "unused", base)).pairs("val").items()
    }
    ratio = (_logps(models["merged"], pairs)[0] - _logps(models["base"], pairs)[0]).view(-1, 2)
    accuracy = float(((ratio[:, 0] > ratio[:, 1]).float() + 0.5 * (ratio[:, 0] == ratio[:, 1]).float()).mean())
    arm_accuracy = json.loads((work / f"{dpo_arm}.json").read_text())["evals"][-1]["val/rewards/accuracy"]
    states = {key: models[key].state_dict() for key in ("base", "sft_arm")}
    return {
        "sft_delta_zero": sparsity(states["base"], states["sft_arm"])["zero"],
        "nll_base": nll["base"], "nll_merged": nll["merged"], "nll_sft_arm": nll["sft_arm"],
        "accuracy_merged": accuracy, "accuracy_dpo_arm": arm_accuracy,
        "sft_gain": (nll["base"] - nll["merged"]) / (nll["base"] - nll["sft_arm"]),
        "dpo_gain": (accuracy - 0.5) / (arm_accuracy - 0.5),
    }  # fmt: skip


def run_entry(name: str, work: Path) -> Result:
    """Trains entry ``name`` under ``work/<name>`` (its base's run at ``work/<base>``) and returns
    its checks' values, evaluations, last training row and first steps (the golden curve)."""
    import torch

    torch.set_num_threads(1)  # the golden curves are one-thread numbers; two entries share two cores
    entry = ENTRIES[name]
    run_dir = work / name
    start = time.perf_counter()
    result: Result = {"evals": [], "curve": {}, "last_step": {}}
    if entry.merge:
        result["merge"] = merge_and_score(name, work)
    else:
        cfg = compose_entry(name, run_dir, work / entry.base if entry.base else None)
        if cfg.get("budget") is not None:  # a budget search drives its own runs (the first one's curve is kept)
            from hydra.utils import instantiate

            result["msft"] = instantiate(cfg.budget).run(cfg, run_dir)
            metrics_dir = run_dir / "rollout_0"
        elif cfg.get("rest") is not None:  # self-training rounds (round 0's curve is kept)
            from hydra.utils import instantiate

            result["rest"] = instantiate(cfg.rest).run(cfg, run_dir)
            metrics_dir = run_dir / "round_0" / "train"
        else:
            train(cfg, run_dir, entry.devices)
            metrics_dir = run_dir
        evals, steps = _read_metrics(metrics_dir)
        curve = {
            key: [steps[s][key] for s in range(1, GOLDEN_STEPS + 1) if key in steps.get(s, {})] for key in GOLDEN_KEYS
        }
        result.update(
            evals=evals, curve={k: v for k, v in curve.items() if v}, last_step=steps[max(steps)] if steps else {}
        )
    result["values"] = [check.measure(result) for check in entry.checks]
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


# ------------------------------------------------------------------------------------------ the tier
def _die_with_parent() -> None:
    """This process gets SIGKILL when the driver dies (Linux' PR_SET_PDEATHSIG, as torch's spawn
    sets it): a killed or timed-out tier leaves no run behind. Its ranks die with it the same way."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not glibc: the driver's SIGTERM handler still stops the workers
        pass


def _worker(name: str, work: Path, out: Path) -> None:
    _die_with_parent()
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
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
) -> dict[str, Result]:
    """Runs ``names`` (and their bases), ``jobs`` at a time in forked processes (one two-rank
    entry at a time); returns each entry's result (``{"error": ...}`` for a run that failed, timed
    out, or started from one that did). ``reuse``: a base (an entry not in ``names``) whose result
    is already in ``work`` is not run again (calibration)."""
    import trainer.build  # noqa: F401 - imported once here: the forked workers inherit it

    ctx = multiprocessing.get_context("fork")
    todo, running, results = needed(names), {}, {}
    todo.sort(key=lambda name: not ENTRIES[name].long)  # stable: the long ones first, the rest in order
    for name in [n for n in todo if n not in names] if reuse else ():
        if (work / f"{name}.json").exists() and "error" not in (
            found := json.loads((work / f"{name}.json").read_text())
        ):
            todo.remove(name)
            results[name] = found
    deadline = time.monotonic() + timeout_s
    stop = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: the finally below stops the workers
    try:
        while todo or running:
            for name in list(todo) if time.monotonic() < deadline else ():
                entry = ENTRIES[name]
                deps = [d for d in (entry.base, *entry.merge) if d is not None]
                multi_rank_busy = entry.devices > 1 and any(ENTRIES[n].devices > 1 for n in running)
                if len(running) >= jobs or multi_rank_busy or any(d in todo or d in running for d in deps):
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
            if time.monotonic() >= deadline:
                for name in todo:
                    results[name] = {"error": f"not run: the tier's {timeout_s:.0f} s ran out"}
                todo = []
            time.sleep(0.2)
            for name, (process, out) in list(running.items()):
                late = time.monotonic() >= deadline
                if out.exists() or not process.is_alive() or late:
                    process.join(timeout=5 if out.exists() else 0)
                    if process.is_alive():
                        process.kill()
                        process.join()
                    if out.exists():
                        results[name] = json.loads(out.read_text())
                    else:
                        why = f"timed out after {timeout_s:.0f} s" if late else f"exit {process.exitcode}, no result"
                        results[name] = {"error": why}
                    del running[name]
    finally:
        for process, _ in running.values():
            process.kill()
        signal.signal(signal.SIGTERM, stop)
    return results


def line(name: str, result: Result) -> str:
    """``learns: dpo        ok      0.8438 >= 0.75 val/rewards/accuracy; -4.017 <= -1 val/rewards/rejected  (14.8 s)``."""
    if "values" not in result:
        error = result.get("error", "").strip().splitlines()
        return f"learns: {name:<11} ERROR   {error[-1] if error else ''}"
    parts = [
        f"{v:.4g} {'<=' if c.lower_is_better else '>='} {c.threshold:g} {c.describes}{'' if c.passes(v) else ' (MISSED)'}"
        for c, v in zip(ENTRIES[name].checks, result["values"])
    ]
    return (
        f"learns: {name:<11} {'ok' if passed(name, result) else 'FAILED':<7} {'; '.join(parts)}  ({result['wall_s']} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated entries (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="entries trained at once (one thread each)")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--update-golden", action="store_true", help="write the passing runs' curves to tests/learns/golden.json"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every result here")
    parser.add_argument("--reuse", action="store_true", help="keep the bases' results already in --work (calibration)")
    parser.add_argument("--timeout-s", type=float, default=900, help="entries not done by then are errors")
    parser.add_argument(
        "--remove-on-term", type=Path, default=None, help="a folder to remove when SIGTERM stops the tier (pytest's)"
    )
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ENTRIES)
    if unknown := sorted(set(names) - set(ENTRIES)):
        parser.error(f"unknown entries {unknown}; known: {', '.join(ENTRIES)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: run_tier's finally stops the workers
    try:
        _main(args, names)
    except SystemExit as stop:
        if stop.code == 143 and args.remove_on_term is not None:
            shutil.rmtree(args.remove_on_term, ignore_errors=True)
        raise


def _main(args: argparse.Namespace, names: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plait-learns-") if args.work is None else nullcontext() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = run_tier(names, work, jobs=args.jobs, timeout_s=args.timeout_s, reuse=args.reuse)
    for name, result in results.items():
        print(line(name, result))
    for name in results:
        if text := golden_line(name, results):
            print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    for text in update_golden(results) if args.update_golden else ():
        print(text)
    failed = [name for name, r in results.items() if not passed(name, r)]
    print(
        f"RESULT passed={len(results) - len(failed)} failed={','.join(failed) or '-'} wall_s={time.perf_counter() - start:.0f}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
