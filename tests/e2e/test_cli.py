"""The CLI end to end on tiny settings: the run directory, --help, a user recipe file, generate,
two processes and the offline wandb logger."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import CLI_TINY, env_with_tests, plait, train_rows
from omegaconf import OmegaConf

from strategies.checkpoint.dcp import is_checkpoint
from trainer.compose import CONF_DIR, bundled_recipes
from trainer.data.tokenizer import Tokenizer

TOKENS_PER_STEP = 8 * 64  # train.global_batch_size x data.seq_len of CLI_TINY
STEPS, SLEEP_S = 4, 0.25
# Every step sleeps SLEEP_S after its batch: the training wall time is at least STEPS x SLEEP_S.
TIMED = ("+callbacks.sleep._target_=harness.SleepPerStep", f"+callbacks.sleep.seconds={SLEEP_S}")


def _timed_plait(*args: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """``plait *args`` (with the sleeping callback) and the wall seconds of the whole subprocess."""
    start = time.perf_counter()
    result = _ok(plait(*args, *TIMED, cwd=cwd, env=env_with_tests()))
    return result, time.perf_counter() - start


def _check_throughput(run_dir: Path, outer_wall_s: float) -> None:
    """summary.json's wall time lies between the sleeps and the subprocess' wall time, and its
    tokens/s is the tokens of every global batch after the first (counted here, not per rank) over
    a time between their sleeps and the whole wall time."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert STEPS * SLEEP_S <= summary["wall_time_s"] <= outer_wall_s, (summary, outer_wall_s)
    warm_tokens = (STEPS - 1) * TOKENS_PER_STEP
    assert warm_tokens / summary["wall_time_s"] <= summary["tokens_per_s"] <= warm_tokens / ((STEPS - 1) * SLEEP_S), (
        summary
    )


def _ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def _val_rows(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(file) if r.get("val/loss")}


@pytest.fixture(scope="module")
def pretrain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 4-step tiny pretrain run: (its run directory, its stdout)."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    result, wall_s = _timed_plait("pretrain", *CLI_TINY, f"run_dir={run_dir}")
    _check_throughput(run_dir, wall_s)
    return run_dir, result.stdout


@pytest.mark.slow
def test_pretrain_writes_every_artifact(pretrain_run: tuple[Path, str]) -> None:
    run_dir, stdout = pretrain_run
    for name in ("config.yaml", "tokenizer.json", "metrics.csv", "loss.png", "summary.json"):
        assert (run_dir / name).is_file(), f"{name} missing from {sorted(p.name for p in run_dir.iterdir())}"
    assert f"plait: run directory {run_dir}" in stdout

    # Checkpoints: the final step, complete, and `last` names it.
    last = run_dir / "checkpoints" / "last"
    assert last.is_symlink() and os.readlink(last) == "step_0000004"
    assert is_checkpoint(run_dir / "checkpoints" / "step_0000004")

    # config.yaml is resolved: no interpolation left, the overrides and the run directory applied.
    text = (run_dir / "config.yaml").read_text()
    assert "${" not in text
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.run_dir == str(run_dir) and cfg.recipe == "pretrain"
    assert cfg.trainer.max_steps == 4 and cfg.model.dim == 64 and cfg.data.seq_len == 64
    assert cfg.data.seed == cfg.seed and cfg.data.cache_dir == os.environ["PLAIT_CACHE_DIR"]

    # tokenizer.json loads and round-trips text.
    tokenizer = Tokenizer.from_file(run_dir / "tokenizer.json")
    assert tokenizer.vocab_size > 256 and tokenizer.decode(tokenizer.encode("To be, or not")) == "To be, or not"

    # metrics.csv: one finite train loss per step, validation at step 0 and the last step.
    train = train_rows(run_dir)
    assert sorted(train) == [1, 2, 3, 4]
    assert all(math.isfinite(float(r["train/loss"])) for r in train.values())
    assert float(train[4]["train/tokens_seen"]) == 4 * TOKENS_PER_STEP
    val = _val_rows(run_dir)
    assert sorted(val) == [0, 4]

    # summary.json: the headline figures, consistent with metrics.csv.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"first_val_loss", "final_val_loss", "tokens_seen", "wall_time_s", "tokens_per_s"} <= set(summary)
    assert summary["tokens_seen"] == 4 * TOKENS_PER_STEP and summary["steps"] == 4
    assert summary["first_val_loss"] == pytest.approx(val[0], rel=1e-6)
    assert summary["final_val_loss"] == pytest.approx(val[4], rel=1e-6)
    # An untrained model predicts about uniformly: loss ~ ln(vocab); 4 warmup steps lower it a little.
    assert abs(summary["first_val_loss"] - math.log(tokenizer.vocab_size)) < 1.0
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert summary["wall_time_s"] >= STEPS * SLEEP_S  # tokens/s: checked in the fixture (_check_throughput)

    # loss.png is a real PNG image.
    png = (run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 200 and height >= 100 and len(png) > 5000


def test_help_lists_recipes_and_groups() -> None:
    script = Path(sys.executable).with_name("plait")
    assert script.is_file(), "the plait console script is not installed next to the interpreter"
    result = _ok(subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120))
    lines = result.stdout.splitlines()
    for name, description in bundled_recipes().items():
        assert any(line.split()[:1] == [name] and description in line for line in lines), name
    groups = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in CONF_DIR.iterdir() if p.is_dir()}
    groups = {name: options for name, options in groups.items() if options}
    assert {"model", "optim", "strategy", "data", "logger"} <= set(groups)
    group_lines = result.stdout.split("Config groups")[1].splitlines()  # a recipe may share a group's name (paft)
    for group, options in groups.items():
        line = next((line for line in group_lines if line.split()[:1] == [group]), None)
        assert line is not None, f"group {group} not listed"
        assert all(option in line for option in options), (group, options, line)
    # plait's version, not Hydra's (which answered --version before).
    version = _ok(subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120))
    assert version.stdout.strip() == f"plait {importlib.metadata.version('plait')}"


@pytest.mark.slow
def test_user_recipe_file_extends_the_bundled_one(tmp_path: Path) -> None:
    recipe = tmp_path / "my_recipes" / "short.yaml"
    recipe.parent.mkdir()
    recipe.write_text("defaults:\n  - pretrain\n  - _self_\n\nrecipe: short\ntrainer:\n  max_steps: 2\n")
    overrides = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")]
    result = _ok(plait(str(recipe), *overrides, cwd=tmp_path))
    # The default run directory is named after the recipe: runs/<recipe>/<time>.
    runs = list((tmp_path / "runs" / "short").iterdir())
    assert len(runs) == 1, runs
    run_dir = runs[0]
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.recipe == "short" and cfg.trainer.max_steps == 2
    assert cfg.model.dim == 64 and cfg.optim.lr == 3.0e-3  # the rest comes from the bundled recipe + overrides
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert sorted(train_rows(run_dir)) == [1, 2]
    assert str(run_dir) in result.stdout


@pytest.mark.slow
def test_generate_continues_the_prompt(pretrain_run: tuple[Path, str]) -> None:
    run_dir, _ = pretrain_run
    result = _ok(plait("generate", f"ckpt={run_dir}", "prompt=To be", "max_new_tokens=20", timeout=120))
    text = result.stdout.rstrip("\n")
    assert text.startswith("To be"), text
    assert text[len("To be") :].strip(), f"no continuation: {text!r}"


@pytest.mark.slow
def test_two_processes_train_one_run(tmp_path: Path, pretrain_run: tuple[Path, str]) -> None:
    # No run_dir: both ranks must agree on the timestamped default (the child must not make its own).
    result, wall_s = _timed_plait("pretrain", *CLI_TINY, "trainer.devices=2", cwd=tmp_path)
    runs = list((tmp_path / "runs" / "pretrain").iterdir())
    assert len(runs) == 1, runs
    run_dir = runs[0]
    _check_throughput(run_dir, wall_s)  # the tokens of both ranks per second, not one rank's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("metrics.csv")] == [
        run_dir.relative_to(tmp_path) / "metrics.csv"
    ]
    assert result.stdout.count("plait: run directory") == 1  # rank 0 reports, rank 1 does not
    # Both ranks wrote their part of the checkpoint.
    step = run_dir / "checkpoints" / "step_0000004"
    assert is_checkpoint(step)
    assert sorted(p.name for p in (step / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    # The two ranks together train the same global batches as one process (same losses, same tokens).
    single, double = train_rows(pretrain_run[0]), train_rows(run_dir)
    assert sorted(double) == sorted(single) == [1, 2, 3, 4]
    for step_index in single:
        assert float(double[step_index]["train/loss"]) == pytest.approx(
            float(single[step_index]["train/loss"]), rel=1e-5
        )
    assert float(double[4]["train/tokens_seen"]) == 4 * TOKENS_PER_STEP
    assert json.loads((run_dir / "summary.json").read_text())["tokens_seen"] == 4 * TOKENS_PER_STEP


@pytest.mark.slow
def test_wandb_logger_runs_offline(tmp_path: Path) -> None:
    try:
        import wandb  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken install raises more than ImportError
        pytest.skip(f"wandb cannot be imported: {err!r}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path / "home")  # no ~/.netrc credentials, no writes to the real home
    run_dir = tmp_path / "run"
    overrides = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")]
    overrides += ["trainer.max_steps=2", "logger=wandb", f"run_dir={run_dir}"]
    result = _ok(plait("pretrain", *overrides, env=env, timeout=240))
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, sorted(p.name for p in run_dir.rglob("*"))
    assert list(offline[0].glob("*.wandb")), "the offline run holds no .wandb log"
    assert (run_dir / "metrics.csv").is_file()  # the wandb preset keeps the csv logger
    output = result.stdout + result.stderr
    assert "wandb sync" in output and "api key" not in output.lower()


@pytest.mark.slow
def test_fsdp_x_tp_on_four_processes_from_the_cli(tmp_path: Path, pretrain_run: tuple[Path, str]) -> None:
    # `plait pretrain strategy=fsdp_tp trainer.devices=4`: dp_shard 2 x tp 2 with
    # sequence and loss parallel, resharded into the same DCP checkpoint layout as one process.
    run_dir = tmp_path / "run"
    _ok(plait("pretrain", *CLI_TINY, "strategy=fsdp_tp", "trainer.devices=4", f"run_dir={run_dir}"))
    single, tp = train_rows(pretrain_run[0]), train_rows(run_dir)
    assert sorted(tp) == sorted(single) == [1, 2, 3, 4]
    for step_index in single:
        assert float(tp[step_index]["train/loss"]) == pytest.approx(float(single[step_index]["train/loss"]), rel=1e-5)
    assert is_checkpoint(run_dir / "checkpoints" / "step_0000004")
