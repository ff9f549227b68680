"""C27: a float override with a zero-padded exponent (``1e-05``) must stay a float, in a sweep too.

Hydra's sweeper prints each sweep value with ``repr`` and parses it again per job; the bug
(facebookresearch/hydra#999) turned exactly ``1e-05`` .. ``1e-09`` into strings.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from harness import CLI_TINY, compose_config, plait
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from strategies.checkpoint.dcp import is_checkpoint
from trainer.config import validate

ONE_STEP = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")] + [
    "trainer.max_steps=1",
    "scheduler.warmup_steps=0",  # step 1 runs at the peak lr, so metrics.csv shows the lr the optimizer used
]


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def _assert_float_lr(job_dir: Path, lr: float) -> None:
    # Both OmegaConf and plain YAML (what a script would use) read a float back.
    text = (job_dir / "config.yaml").read_text()
    for loaded in (OmegaConf.create(text).optim.lr, yaml.safe_load(text)["optim"]["lr"]):
        assert type(loaded) is float and loaded == lr, (job_dir, loaded)
    with open(job_dir / "metrics.csv", newline="") as file:
        logged = [float(row["train/lr"]) for row in csv.DictReader(file) if row.get("train/lr")]
    assert logged == [pytest.approx(lr, rel=1e-6)]  # logged as float32


@pytest.mark.slow
def test_multirun_sweep_gives_each_job_a_float(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _ok(plait("--multirun", "optim.lr=1.0e-5,1.0e-6", *ONE_STEP, f"run_dir={sweep}", cwd=tmp_path))
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["job0_optim.lr:1e-05", "job1_optim.lr:1e-06"]
    _assert_float_lr(sweep / "job0_optim.lr:1e-05", 1.0e-5)
    _assert_float_lr(sweep / "job1_optim.lr:1e-06", 1.0e-6)


@pytest.mark.parametrize("text", ["1e-05", "3e-07", "1e-09", "1e-4", "1e-10", "1.0e-5", "1.0e-6"])
def test_single_override_composes_to_a_float(text: str) -> None:
    value = float(text)
    cfg = compose_config([f"optim.lr={text}"])
    assert type(cfg.optim.lr) is float and cfg.optim.lr == value
    validate(cfg)  # the optimizer's signature types lr as a float: no "must be float" problem
    # The sweeper's round trip: the value printed with repr and parsed again is the same float.
    parser = OverridesParser.create()
    again = parser.parse_override(f"optim.lr={value!r}").value()
    assert type(again) is float and again == value
    assert compose_config([f"optim.lr={value!r}"]).optim.lr == value


@pytest.mark.slow
def test_multirun_job_with_two_processes_is_one_run_directory(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = plait("--multirun", "optim.lr=1e-05", "trainer.devices=2", *ONE_STEP, f"run_dir={sweep}", cwd=tmp_path)
    _ok(result)
    # One job directory (plus Hydra's multirun.yaml); rank 1 made no directory of its own.
    assert sorted(p.name for p in sweep.iterdir()) == ["job0", "multirun.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    job = sweep / "job0"
    assert [p.relative_to(sweep) for p in sweep.rglob("metrics.csv")] == [Path("job0/metrics.csv")]
    step = job / "checkpoints" / "step_0000001"
    assert is_checkpoint(step)
    assert sorted(p.name for p in (step / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert json.loads((job / "summary.json").read_text())["tokens_seen"] == 8 * 64
    assert result.stdout.count("plait: run directory") == 1
    _assert_float_lr(job, 1e-05)
