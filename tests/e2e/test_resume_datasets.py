"""Kill -9 and resume is bit-exact on Hugging Face ``datasets`` sources: a folder of parquet shards
(``data.path=``, materialised) and the same shards streamed (``data=stream``, an IterableDataset
resumed from its ``state_dict``). Harness of tests/e2e/test_resume.py: a straight run of 2N steps,
a run SIGKILLed once its step-N checkpoint is complete, continued with ``resume=last``; losses,
gradient norms and learning rates of steps N+1..2N equal the straight run's bitwise."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import CLI_TINY, plait, train_rows

from strategies.checkpoint.dcp import is_checkpoint

N = 3
STEP_N = f"step_{N:07d}"
BASE = [o for o in CLI_TINY if not o.startswith(("trainer.max_steps=", "data.eval_rows="))] + [
    f"trainer.max_steps={2 * N}", f"callbacks.checkpoint.every_n_steps={N}", "callbacks.checkpoint.keep_last=0",
    "data.vocab_size=512", "data.eval_rows=4",
]  # fmt: skip
SOURCES = {"parquet_shards": [], "streaming": ["data=stream", "data.eval_docs=4"]}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three parquet shards of 60 documents (Shakespeare paragraphs, tens of tokens each: the
    checkpoint at step N lies many documents into the stream, inside one of them)."""
    import datasets

    from trainer.data import default_corpus

    root = tmp_path_factory.mktemp("shards")
    scenes = default_corpus.load_bundled(["shakespeare"])[:20]
    docs = [p for d in scenes for p in d.text.split("\n\n") if len(p) > 80][:180]
    for s in range(3):
        datasets.Dataset.from_dict({"text": docs[s * 60 : (s + 1) * 60]}).to_parquet(
            str(root / f"part-{s:03d}.parquet")
        )
    return root


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def _kill_after_step_n(args: list[str], run_dir: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", *args, f"run_dir={run_dir}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while (
            not is_checkpoint(run_dir / "checkpoints" / STEP_N)
            and process.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, (
        f"the run ended on its own (exit {process.returncode}):\n{stderr[-3000:]}"
    )
    assert not (run_dir / "summary.json").exists(), "the kill came after the run had finished"


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SOURCES))
def test_kill_and_resume_is_bit_exact(source: str, shards: Path, tmp_path: Path) -> None:
    args = [*BASE, f"data.path={shards}", *SOURCES[source]]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _ok(plait(*args, f"run_dir={straight}"))
    _kill_after_step_n(args, killed)
    _ok(plait(*args, f"run_dir={killed}", "resume=last"))
    reference, resumed = train_rows(straight), train_rows(killed)
    for row in range(N + 1, 2 * N + 1):
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert resumed[row][key] == reference[row][key], (source, row, key, resumed[row][key], reference[row][key])
    assert (
        len({reference[row]["train/loss"] for row in range(1, 2 * N + 1)}) == 2 * N
    )  # distinct batches, not one repeated
    with open(killed / "metrics.csv", newline="") as file:  # it resumed: step 1 was trained once, by the killed run
        assert len([r for r in csv.DictReader(file) if r["step"] == "1" and r["train/loss"]]) == 1
