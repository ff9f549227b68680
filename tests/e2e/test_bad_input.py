"""Bad input fails fast: every problem in one message, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import CLI_TINY, plait

from trainer.compose import bundled_recipes


def _assert_clean_failure(result: subprocess.CompletedProcess[str]) -> str:
    """Exit code 2 with a plait error and no traceback; returns stderr."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "plait: error:" in result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr
    return result.stderr


def _tree(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry under ``root``: (mtime in ns, content hash or link target)."""
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            state[str(path.relative_to(root))] = (path.lstat().st_mtime_ns, "-> " + os.readlink(path))
        elif path.is_file():
            state[str(path.relative_to(root))] = (
                path.stat().st_mtime_ns,
                hashlib.sha256(path.read_bytes()).hexdigest(),
            )
        else:
            state[str(path.relative_to(root))] = (path.stat().st_mtime_ns, "dir")
    return state


def test_a_data_group_of_another_recipe_names_the_group_not_its_field(tmp_path: Path) -> None:
    """``plait kto data=stream data.path=x``: data.path is stream's field, so the refusal is the
    objective's (use data=preference), not 'Could not override data.path', and the alias's own
    data.unpaired=true, which stream lacks, adds no line of its own."""
    stderr = _assert_clean_failure(
        plait("kto", "data=stream", "data.path=x", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    )
    problems = [line for line in stderr.splitlines() if line.startswith("  - ")]
    assert [p for p in problems if "data.path=x" not in p] == [
        "  - objective KTO trains on preference pairs; use data=preference (or preference_synthetic)"
    ], stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    """Every override that does not apply at once, before the trainer loads (trainer.overrides);
    once they apply, every problem of the config at once (trainer.preflight)."""
    run_dir = tmp_path / "run"
    typos = ["train.micro_batch=3", "optim.learning_rate=1e-4"]
    bad = ["trainer.max_steps=abc", "train.global_batch_size=7", "data.seq_len=4096"]
    stderr = _assert_clean_failure(plait(*CLI_TINY, *typos, *bad, f"run_dir={run_dir}", cwd=tmp_path))
    problems = [line for line in stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 2, stderr
    assert any("train.micro_batch" in p and "train.micro_batch_size" in p for p in problems), stderr  # did you mean
    assert any("use optim.lr=1e-4" in p for p in problems), stderr  # TRL's name (trainer.foreign_names)
    stderr = _assert_clean_failure(plait(*CLI_TINY, *bad, f"run_dir={run_dir}", cwd=tmp_path))
    assert "invalid configuration" in stderr
    problems = [line for line in stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 3, stderr
    assert any("trainer.max_steps='abc'" in p and "int" in p for p in problems), stderr
    assert any("train.global_batch_size=7" in p and "multiple" in p for p in problems), stderr
    assert any("data.seq_len=4096" in p and "model.max_seq_len=256" in p for p in problems), stderr
    assert not run_dir.exists() and list(tmp_path.iterdir()) == [], "a failed start must not create a run directory"


@pytest.mark.slow
def test_missing_data_path_names_the_fix(tmp_path: Path) -> None:
    stderr = _assert_clean_failure(
        plait(*CLI_TINY, "data.path=/nonexistent", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    )
    assert "data.path=/nonexistent does not exist" in stderr
    assert "point data.path at" in stderr
    assert list(tmp_path.iterdir()) == []


def test_a_fifo_as_data_path_is_refused_before_the_run_directory(tmp_path: Path) -> None:
    """Reading a FIFO blocks until a writer comes: it hung after the run directory was made."""
    os.mkfifo(tmp_path / "corpus.txt")
    stderr = _assert_clean_failure(
        plait(*CLI_TINY, "data.path=corpus.txt", f"run_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    )
    assert stderr.count("plait: error:") == 1
    fifo = tmp_path / "corpus.txt"  # made absolute where typed (trainer.data.config_paths.absolute_paths)
    assert f"data.path={fifo}: {fifo} is a FIFO, not a regular file or a folder; copy the data into a file" in stderr
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.txt"]


@pytest.mark.slow
def test_fresh_start_into_a_run_with_checkpoints_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_0000004"
    (step / "rng").mkdir(parents=True)
    files = {".metadata": b"dcp", "__0_0.distcp": b"weights", "meta.pt": b"loop", "rng/rank_00000.pt": b"rng"}
    for name, data in files.items():
        (step / name).write_bytes(data)
    (run_dir / "checkpoints" / "last").symlink_to(step.name)
    (run_dir / "config.yaml").write_text("recipe: pretrain\n")
    (run_dir / "metrics.csv").write_text("step,train/loss\n0,8.3\n")
    before = _tree(tmp_path)

    stderr = _assert_clean_failure(plait(*CLI_TINY, f"run_dir={run_dir}", cwd=tmp_path))
    assert f"run_dir={run_dir} already holds checkpoints" in stderr
    assert f"continue it with plait resume {run_dir}" in stderr
    assert _tree(tmp_path) == before, "the refused run changed the existing run directory"


def test_unknown_recipe_lists_the_bundled_ones(tmp_path: Path) -> None:
    stderr = _assert_clean_failure(plait("pretrian", *CLI_TINY, cwd=tmp_path))
    assert "unknown recipe 'pretrian'" in stderr
    listed = stderr.split("bundled recipes:", 1)[1]
    assert bundled_recipes() and all(name in listed for name in bundled_recipes())
    stderr = _assert_clean_failure(plait(str(tmp_path / "nope.yaml"), cwd=tmp_path))
    assert "nope.yaml does not exist" in stderr
    assert list(tmp_path.iterdir()) == []


def _untrained_run(run_dir: Path) -> Path:
    """A run directory as a run writes it (config, tokenizer, checkpoint), of an untrained 1-block model."""
    import torch
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from strategies.checkpoint.dcp import seal
    from trainer.data.tokenizer import train_bpe
    from trainer.model_node import instantiate_model

    tokenizer = train_bpe(["hello there, how are you?"] * 4, vocab_size=300)
    model = {"_target_": "trainer.models.llama.Llama", "dim": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 32}
    cfg = OmegaConf.create({"model": model})
    ckpt = run_dir / "checkpoints" / "last"
    ckpt.mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    tokenizer.save(run_dir / "tokenizer.json")
    dcp.save({"model": instantiate_model(cfg.model, vocab_size=tokenizer.vocab_size).state_dict()}, checkpoint_id=ckpt)
    torch.save({}, ckpt / "meta.pt")
    seal(ckpt)
    return run_dir


@pytest.mark.slow
def test_chat_refuses_a_line_that_is_not_utf8(tmp_path: Path) -> None:
    """The first line is answered; the second, not UTF-8, ends the chat with one line naming it."""
    run_dir = _untrained_run(tmp_path / "run")
    result = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "chat", f"ckpt={run_dir}", "max_new_tokens=2", "temperature=0"],
        input=b"hello\nhow \xff are you\n",
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    stderr = _assert_clean_failure(
        subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(), result.stderr.decode())
    )
    assert stderr.count("plait: error:") == 1
    assert "plait: error: stdin line 2 is not UTF-8 text (byte 0xff at offset 4); convert it to UTF-8" in stderr, stderr
    assert len(result.stdout.decode().splitlines()) >= 1  # the answer to line 1
