"""``plait resume RUN_DIR trainer.max_steps=N`` continues a run from its own config, in its own
directory, saying and recording what changed (the CLI in subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two CLI runs, ~20 s


def _plait(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_resume_continues_the_run_from_its_config(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = _plait(
        "sft", "model=nano", "data=synthetic", "trainer.max_steps=4", "train.eval_every=0",
        "callbacks.checkpoint.every_n_steps=2", f"run_dir={run_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    again = _plait("resume", str(run_dir), "trainer.max_steps=6", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from {run_dir}/checkpoints/step_0000004" in again.stderr
    assert "resume: trainer.max_steps: 4 -> 6" in again.stderr
    (line,) = (run_dir / "resumes.jsonl").read_text().splitlines()
    assert json.loads(line) == {
        "step": 4, "checkpoint": f"{run_dir}/checkpoints/step_0000004", "changed": {"trainer.max_steps": [4, 6]}
    }  # fmt: skip
    assert (run_dir / "checkpoints" / "step_0000006").is_dir() and not (tmp_path / "outputs").exists()
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    trained = sorted(
        {int(float(r.split(",")[header.index("step")])) for r in rows[1:] if r.split(",")[header.index("train/loss")]}
    )
    assert trained[-1] == 6
    # Past max_steps: refused, not a silent no-op; the old form typed without the run's overrides: pointed here.
    short = _plait("resume", str(run_dir), "trainer.max_steps=3", cwd=tmp_path)
    assert (
        short.returncode == 2 and "is at step 6 and trainer.max_steps=3: the resume would train nothing" in short.stderr
    )
    bare = _plait("sft", f"run_dir={run_dir}", "resume=last", cwd=tmp_path)
    assert bare.returncode == 2 and f"plait resume {run_dir} [overrides]" in bare.stderr, bare.stderr[-2000:]


def test_a_run_on_a_relative_data_path_resumes_from_another_folder(tmp_path) -> None:
    """``data.path=corpus/`` typed in one folder is recorded absolute: ``plait resume RUN`` from another
    folder finds the files, and ``data.path=./corpus`` typed again in the first is the same path."""
    (tmp_path / "a" / "corpus").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    for i in range(4):
        (tmp_path / "a" / "corpus" / f"d{i}.txt").write_text(" ".join(f"word{(i * 7 + k) % 40}" for k in range(2000)))
    run_dir, common = tmp_path / "run", ["data.vocab_size=300", "data.seq_len=64", "train.eval_every=0"]
    first = _plait(
        "pretrain", "model=nano", "data.path=corpus/", *common, "trainer.max_steps=2", f"run_dir={run_dir}",
        cwd=tmp_path / "a",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"path: {tmp_path / 'a' / 'corpus'}\n" in (run_dir / "config.yaml").read_text()
    again = _plait("resume", str(run_dir), "trainer.max_steps=3", cwd=tmp_path / "b")
    assert again.returncode == 0, again.stderr[-2000:]
    typed = _plait(
        "pretrain", "model=nano", "data.path=./corpus", *common, "trainer.max_steps=4", f"run_dir={run_dir}",
        "resume=last", cwd=tmp_path / "a",
    )  # fmt: skip
    assert typed.returncode == 0 and "resuming from" in typed.stderr, typed.stderr[-2000:]
