"""C30: empty data, or a limit that leaves no training batch, is a clear error before any step.

Lightning-AI/pytorch-lightning#12830: a train loader of length 0 reached a division by the number
of batches (ZeroDivisionError), and a fractional ``limit_train_batches`` that rounded down to 0
batches silently trained nothing.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import pytest
from harness import CLI_TINY, compose_config, plait

from trainer.build import build_data
from trainer.data.base import DataError
from trainer.run import check_train_batches


def _assert_data_error(result: subprocess.CompletedProcess[str], run_dir: Path) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 2, f"exit {result.returncode}\n{output[-5000:]}"
    assert "plait: error:" in result.stderr
    for bad in ("Traceback", "ZeroDivisionError", "MisconfigurationException"):
        assert bad not in output, output[-5000:]
    assert not re.search(r"\bnan\b", output, re.IGNORECASE), output[-5000:]
    assert not run_dir.exists(), "a failed start must leave no run directory"
    return result.stderr


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.mark.slow
def test_dataset_empty_after_filtering_is_a_data_error(tmp_path: Path) -> None:
    # Every record is whitespace-only, so the loader's filter leaves no document.
    data = _write_jsonl(tmp_path / "blank.jsonl", ["", "   ", "\n\n"])
    run_dir = tmp_path / "run"
    stderr = _assert_data_error(plait(*CLI_TINY, f"data.path={data}", f"run_dir={run_dir}", cwd=tmp_path), run_dir)
    assert f"data.path=['{data}']" in stderr and "no documents" in stderr
    assert "point data.path at" in stderr  # the fix


@pytest.mark.slow
def test_dataset_smaller_than_one_global_batch_is_a_data_error(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "small.jsonl", ["To be, or not to be: that is the question."] * 3)
    run_dir = tmp_path / "run"
    stderr = _assert_data_error(plait(*CLI_TINY, f"data.path={data}", f"run_dir={run_dir}", cwd=tmp_path), run_dir)
    assert f"data.path=['{data}']" in stderr and "fewer than one global batch" in stderr
    assert "lower train.global_batch_size or data.seq_len" in stderr  # the fix


def test_empty_file_is_a_data_error_naming_the_path(tmp_path: Path) -> None:
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    with pytest.raises(DataError, match=r"data\.path=.*empty\.jsonl.*point data\.path at"):
        build_data(compose_config([f"data.path={data}"])).prepare()


def _nine_batch_config(tmp_path: Path) -> list[str]:
    """Overrides whose training data is exactly 9 global batches (one full-size micro-batch each)."""
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(60)) + "." for _ in range(150)]
    data = _write_jsonl(tmp_path / "nine.jsonl", texts)
    overrides = [f"data.path={data}", "train.global_batch_size=1", "train.micro_batch_size=1"]
    num_rows = len(build_data(compose_config(overrides)).prepare().train)
    batch = next((b for b in range(1, num_rows + 1) if num_rows // b == 9), None)
    assert batch is not None, f"{num_rows} rows cannot make exactly 9 batches; change the texts"
    return [f"data.path={data}", f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}"]


@pytest.mark.slow
def test_limit_rounding_to_zero_batches_is_an_error(tmp_path: Path) -> None:
    nine = _nine_batch_config(tmp_path)
    data = build_data(compose_config(nine))
    assert data.steps_per_epoch() == 9
    # int(9 x 0.1) = 0 batches is refused; int(9 x 0.12) = 1 batch and whole counts are fine.
    with pytest.raises(DataError, match=r"trainer\.limit_train_batches=0\.1 of 9 training batches"):
        check_train_batches(compose_config([*nine, "trainer.limit_train_batches=0.1"]), data)
    for ok in ("0.12", "1", "1.0"):
        check_train_batches(compose_config([*nine, f"trainer.limit_train_batches={ok}"]), data)

    run_dir = tmp_path / "run"
    result = plait(*CLI_TINY, *nine, "trainer.limit_train_batches=0.1", f"run_dir={run_dir}", cwd=tmp_path)
    stderr = _assert_data_error(result, run_dir)
    assert "trainer.limit_train_batches=0.1" in stderr and "9 training batches" in stderr
    assert "at least 0.1112" in stderr  # the fix: the smallest fraction that keeps one batch
