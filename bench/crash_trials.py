"""Kill -9 and corruption trials: every resume is bit-exact and metrics.csv equals an uninterrupted run's.

Kill trials: a run (1 process, or 2 processes with FSDP) is SIGKILLed as a whole process group,
either at a planted point of the checkpoint path (bench/crash_entry.py: after a step's row, inside
a save before and after its manifest, before the ``last`` link moves, inside a prune) or at a
random moment; then ``resume=last`` finishes it. Passed when every checkpoint directory left by
the kill either verifies or is skipped with a message, the resumed run's metrics.csv has each
step exactly once with ``train/loss``, ``train/grad_norm``, ``train/lr``, ``train/tokens_seen``
and ``val/loss`` bitwise equal to the uninterrupted run's, and its final weights are bitwise equal.

Corruption trials: the newest checkpoint of a run killed mid-way is damaged (4 KiB of a shard
overwritten, a shard or meta.pt truncated, its manifest deleted, a file planted); ``resume=last``
must name the skipped checkpoint, fall back to the previous one and again end bit-exact.

Invocation (~25 minutes on 2 idle cores)::

    python bench/crash_trials.py                 # all trials
    python bench/crash_trials.py --random 4      # fewer random kills
    python bench/crash_trials.py --async-save    # the killed runs save in the background
                                                 # (callbacks.checkpoint.async_save=true; references synchronous)

The last line is ``RESULT kill_trials=<n> kill_ok=<n> corruption_trials=<n> corruption_ok=<n>``.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strategies.checkpoint.dcp import load_model_weights, verify_checkpoint  # noqa: E402
from trainer.rundir import step_dirs  # noqa: E402

STEPS = 8
RUN = [
    "model=nano", "data.seq_len=64", "data.eval_rows=8", "train.global_batch_size=8", "train.micro_batch_size=4",
    "train.eval_every=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "strategy.timeout_s=120",
    f"trainer.max_steps={STEPS}", "callbacks.checkpoint.every_n_steps=2", "callbacks.checkpoint.keep_last=2",
    "~callbacks.plots",
]  # fmt: skip
LAYOUTS = {1: [], 2: ["strategy=fsdp", "trainer.devices=2"]}
KEYS = ("train/loss", "train/grad_norm", "train/lr", "train/tokens_seen", "val/loss")
# (processes, point, occurrence): saves happen at steps 2, 4, 6, 8; prunes from the third save on.
PLANTED = [
    (1, "row", 1), (1, "row", 3), (1, "files", 1), (1, "files", 2), (1, "rename", 2), (1, "link", 2),
    (1, "link", 4), (1, "prune", 1), (1, "prune", 2),
    (2, "row", 2), (2, "files", 2), (2, "rename", 3), (2, "link", 1), (2, "prune", 1),
]  # fmt: skip
# With --async-save: killed while the background write of the second save is under way (training goes on).
PLANTED_ASYNC = [(1, "background", 2), (1, "background", 3), (2, "background", 2)]
OPTIONS: list[str] = []  # added to the killed and resumed runs (not to the references)


def _plait(
    args: list[str], run_dir: Path, env: dict[str, str] | None = None, entry: bool = False, reference: bool = False
) -> subprocess.Popen:
    command = [str(ROOT / "bench" / "crash_entry.py")] if entry else ["-m", "trainer.cli"]
    options = [] if reference else OPTIONS
    return subprocess.Popen(
        [sys.executable, *command, *RUN, *options, *args, f"run_dir={run_dir}"],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen, timeout: float = 900) -> tuple[int, str]:
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
    return process.returncode, stderr


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def weights(run_dir: Path, like: Path) -> dict:
    """The final checkpoint's model weights (one process, any saved layout)."""
    from omegaconf import OmegaConf

    from trainer.data.tokenizer import Tokenizer
    from trainer.model_node import instantiate_model

    cfg = OmegaConf.load(like / "config.yaml")
    model = instantiate_model(
        cfg.model,
        vocab_size=cfg.model.get("vocab_size") or Tokenizer.from_file(str(like / "tokenizer.json")).vocab_size,
    )
    load_model_weights(run_dir / "checkpoints" / f"step_{STEPS:07d}", model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def compare(run_dir: Path, reference: Path) -> str | None:
    """Why the finished ``run_dir`` differs from the uninterrupted ``reference``, or None."""
    import torch

    got, want = rows(run_dir), rows(reference)
    steps = [r["step"] for r in got]
    if steps != [r["step"] for r in want]:
        return f"steps {steps} != {[r['step'] for r in want]}"
    for a, b in zip(got, want):
        if diff := [k for k in KEYS if a.get(k, "") != b.get(k, "")]:
            return f"step {a['step']}: {', '.join(f'{k} {a.get(k)} != {b.get(k)}' for k in diff)}"
    mine, theirs = weights(run_dir, reference), weights(reference, reference)
    if bad := [k for k in theirs if not torch.equal(mine[k], theirs[k])]:
        return f"final weights differ: {bad[:3]}"
    return None


def leftovers(run_dir: Path) -> str:
    """What the kill left in checkpoints/: each step_* directory's state."""
    found = []
    for path in step_dirs(run_dir / "checkpoints"):
        reason = verify_checkpoint(path)
        found.append(f"{path.name}:{'ok' if reason is None else 'damaged'}")
    extra = sorted(
        p.name
        for p in (run_dir / "checkpoints").glob("*")
        if p.name.endswith((".tmp", ".old")) or p.name.startswith(".pruned-")
    )
    return " ".join(found + extra)


def resume(run_dir: Path, layout: list[str], reference: Path) -> tuple[bool, str]:
    """``resume=last`` to the end; (passed, detail). Every damaged checkpoint must be reported."""
    damaged = [p.name for p in step_dirs(run_dir / "checkpoints") if verify_checkpoint(p) is not None]
    if f"step_{STEPS:07d}" in [p.name for p in step_dirs(run_dir / "checkpoints") if p.name not in damaged]:
        why = compare(run_dir, reference)  # killed after its last checkpoint: a resume would train nothing (refused)
        return why is None, f"complete at step {STEPS}, nothing to resume: {why or 'bit-exact'}"
    code, stderr = _finish(_plait([*layout, "resume=last"], run_dir))
    if code != 0:
        return False, f"resume exit {code}: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}"
    unreported = [name for name in damaged if f"skipped {run_dir / 'checkpoints' / name}" not in stderr]
    if unreported:
        return False, f"damaged {unreported} skipped without a message"
    why = compare(run_dir, reference)
    return why is None, why or "bit-exact"


def kill_trial(
    processes: int, point: str | None, count: int, reference: Path, work: Path, rng: random.Random
) -> tuple[bool, str]:
    run_dir, layout = work / "run", LAYOUTS[processes]
    if point is not None:
        code, stderr = _finish(_plait(layout, run_dir, env={"PLAIT_CRASH_AT": f"{point}:{count}"}, entry=True))
    else:  # a random moment: after k rows, plus up to 0.5 s
        process, k = _plait(layout, run_dir), rng.randint(1, STEPS)
        while process.poll() is None and not ((run_dir / "metrics.csv").exists() and len(rows(run_dir)) > k):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.5))
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        code, stderr = _finish(process)
    if code != -signal.SIGKILL:
        return False, f"the run was not killed (exit {code}): {stderr.strip()[-300:]}"
    state = leftovers(run_dir)
    if not step_dirs(run_dir / "checkpoints"):  # killed before its first checkpoint: start again
        code, stderr = _finish(_plait(layout, run_dir))
        why = f"exit {code}: {stderr.strip()[-300:]}" if code else compare(run_dir, reference)
        return why is None, f"[no checkpoint {state}] fresh start into it: {why or 'bit-exact'}"
    passed, detail = resume(run_dir, layout, reference)
    return passed, f"[{state}] {detail}"


DAMAGE = {
    "overwrite_shard_4k": lambda p: _overwrite(p / "__0_0.distcp"),
    "truncate_shard": lambda p: os.truncate(p / "__0_0.distcp", (p / "__0_0.distcp").stat().st_size // 2),
    "truncate_meta": lambda p: os.truncate(p / "meta.pt", 100),
    "delete_manifest": lambda p: (p / "manifest.json").unlink(),
    "plant_file": lambda p: (p / "rng" / "rank_00007.pt").write_bytes(b"planted"),
}


def _overwrite(path: Path) -> None:
    with open(path, "r+b") as file:
        file.seek(min(4096, path.stat().st_size // 2))
        file.write(os.urandom(4096))


def corruption_trial(damage: str, killed: Path, reference: Path, work: Path) -> tuple[bool, str]:
    run_dir = work / "run"
    shutil.copytree(killed, run_dir, symlinks=True)
    newest = step_dirs(run_dir / "checkpoints")[-1]
    DAMAGE[damage](newest)
    passed, detail = resume(run_dir, [], reference)
    return passed, f"{newest.name} damaged; {detail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random", type=int, default=8, help="random-moment kills (half 1 process, half 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-save", action="store_true", help="killed runs save in the background")
    args = parser.parse_args()
    if args.async_save:
        OPTIONS.append("callbacks.checkpoint.async_save=true")
    rng = random.Random(args.seed)
    results: list[tuple[str, bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="plait-crash-") as tmp:
        tmp_path = Path(tmp)
        references = {}
        for processes, layout in LAYOUTS.items():
            references[processes] = tmp_path / f"reference{processes}"
            code, stderr = _finish(_plait(layout, references[processes], reference=True))
            if code != 0:
                raise SystemExit(f"reference run ({processes} processes) failed: {stderr[-2000:]}")
        planted = [*PLANTED, *(PLANTED_ASYNC if args.async_save else [])]
        trials = [*planted, *[(1 + i % 2, None, 0) for i in range(args.random)]]
        for i, (processes, point, count) in enumerate(trials):
            work = tmp_path / f"kill{i}"
            passed, detail = kill_trial(processes, point, count, references[processes], work, rng)
            name = f"kill {processes}p {point or 'random'}{f':{count}' if point else ''}"
            results.append((name, passed, detail))
            print(f"{name:<24} {'ok  ' if passed else 'FAIL'} {detail}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
        killed = tmp_path / "killed"  # killed after its step-6 checkpoint: steps 4 and 6 kept
        _finish(_plait([], killed, env={"PLAIT_CRASH_AT": "row:4"}, entry=True))
        for damage in DAMAGE:
            work = tmp_path / f"corrupt-{damage}"
            passed, detail = corruption_trial(damage, killed, references[1], work)
            results.append((f"corrupt {damage}", passed, detail))
            print(f"{'corrupt ' + damage:<24} {'ok  ' if passed else 'FAIL'} {detail}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    kills = [r for r in results if r[0].startswith("kill")]
    corrupt = [r for r in results if r[0].startswith("corrupt")]
    print(
        f"RESULT kill_trials={len(kills)} kill_ok={sum(r[1] for r in kills)} "
        f"corruption_trials={len(corrupt)} corruption_ok={sum(r[1] for r in corrupt)}"
    )
    if not all(r[1] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
