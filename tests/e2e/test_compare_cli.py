"""Comparing runs from the CLI: a 2-job sweep with csv, TensorBoard and wandb (offline) at once,
job folders named by their overrides, ``plait compare`` on the sweep, ``plait generate`` on the
folder of runs, and none of Lightning's banners in the output."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
from harness import CLI_TINY, plait

STEPS = 2
SWEEP = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")] + [
    f"trainer.max_steps={STEPS}", f"train.eval_every={STEPS}", "logger=[csv,tensorboard,wandb]",
]  # fmt: skip
JOBS = {"job0_optim.lr:0.001": 0.001, "job1_optim.lr:0.0003": 0.0003}
BANNERS = (
    "GPU available",
    "TPU available",
    "litlogger",
    "Initializing distributed",
    "distributed_backend=",
    "LeafSpec",
    "`Trainer.fit` stopped",
    "torch.distributed is disabled",
)


def _ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def wandb_records(run_dir: Path) -> tuple[str, dict]:
    """(display name, config) of the one offline wandb run of ``run_dir``, read from its ``.wandb``
    log (LevelDB log blocks of protobuf ``Record``s; wandb-core keeps no plain-text copy offline)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = run_dir.glob("wandb/offline-run-*/*.wandb")
    data, pos, chunk, records = log.read_bytes(), 7, b"", []  # 7: the ":W&B" file header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(pb.Record.FromString(chunk))
            chunk = b""
    name = next(r.run.display_name for r in records if r.WhichOneof("record_type") == "run")
    config = {
        i.key: json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for i in r.config.update
    }
    return name, config


def _csv_val(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(file) if r.get("val/loss")}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A ``--multirun`` over two learning rates: (the sweep folder, stdout + stderr)."""
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("sweep")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(root / "home")  # no credentials, no writes to the real home
    folder = root / "runs" / "pretrain" / "sweep"
    result = _ok(
        plait("pretrain", "--multirun", "optim.lr=1e-3,3e-4", *SWEEP, f"run_dir={folder}", env=env, timeout=400)
    )
    return folder, result.stdout + result.stderr


def test_a_sweep_writes_every_logger_in_folders_named_by_its_overrides(sweep: tuple[Path, str]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, output = sweep
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == sorted(JOBS)
    for job, lr in JOBS.items():
        run_dir = folder / job
        val = _csv_val(run_dir)
        assert sorted(val) == [0, STEPS]
        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert {e.step: e.value for e in events.Scalars("val/loss")} == pytest.approx(val, rel=1e-6)
        name, config = wandb_records(run_dir)  # its own wandb run (not job0's reused), named and configured
        words = name.split()  # the recipe and the job's overrides as Hydra's sweeper wrote them
        assert words[0] == "pretrain" and f"optim.lr={lr!r}" in words and "model=nano" in words, name
        assert not any(w.startswith(("run_dir=", "logger=")) for w in words), name
        assert config["optim"]["lr"] == lr and config["model"]["dim"] == 64 and config["recipe"] == "pretrain"
    for banner in BANNERS:
        assert banner not in output, banner
    # One data summary per job, before training.
    summaries = [line for line in output.splitlines() if line.startswith("plait: data: ")]
    assert len(summaries) == 2 and "training rows" in summaries[0] and "held-out rows" in summaries[0], summaries
    assert "documents" in summaries[0] and "vocabulary" in summaries[0]


def test_compare_tables_the_sweep_and_plots_its_validation_losses(sweep: tuple[Path, str]) -> None:
    folder, _ = sweep
    result = _ok(plait("compare", str(folder), timeout=120))
    header, rule, *rows = result.stdout.splitlines()[:4]
    assert header.split() == ["run", "optim.lr", "steps", "val", "loss", "train", "loss", "tokens/s"], header
    for row, (job, lr) in zip(rows, JOBS.items()):
        summary = json.loads((folder / job / "summary.json").read_text())
        cells = row.split()
        assert cells[:3] == [job, repr(lr), str(STEPS)], row
        assert float(cells[3]) == pytest.approx(summary["final_val_loss"], rel=1e-3)
    png = (folder / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert f"plait: wrote {folder / 'compare.png'}" in result.stdout
    # The job folders go back into an override as they are (no "=" or "," in their names).
    jobs = ",".join(str(folder / job) for job in JOBS)
    again = _ok(plait("compare", f"runs=[{jobs}]", f"out={folder / 'again.png'}", timeout=120))
    assert again.stdout.splitlines()[:4] == result.stdout.splitlines()[:4] and (folder / "again.png").is_file()


def test_generate_on_the_folder_of_runs_loads_the_job_that_saved_last(sweep: tuple[Path, str]) -> None:
    folder, _ = sweep
    result = _ok(plait("generate", f"ckpt={folder.parent}", "max_new_tokens=2", timeout=120))
    last = folder / "job1_optim.lr:0.0003" / "checkpoints" / f"step_{STEPS:07d}"
    assert f"plait: loaded {last}" in result.stdout + result.stderr
    for banner in BANNERS:
        assert banner not in result.stdout + result.stderr, banner


# Slow: CLI runs or waits on timeouts (10-30 s for the file); left out of the default run to keep it
# near 15 min on 2 cores since it runs tests/dist/ (python -m pytest -m slow runs them).
pytestmark = pytest.mark.slow
