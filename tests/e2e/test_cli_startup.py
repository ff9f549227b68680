"""``plait COMMAND --help`` and a mistyped override answer without importing torch or Lightning
(seconds of start-up; docs/benchmarks.md has the figures): checked on ``python -X importtime``'s
list of the modules the command imported, not on a clock."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "lightning")


def _imported(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """The result of ``python -X importtime -m trainer.cli *argv`` and the top-level packages it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trainer.cli", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line.rpartition("|")[2].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    return result, {name.split(".")[0] for name in lines}


@pytest.mark.parametrize(
    "argv", [("--help",), ("sft", "--help"), ("dpo", "--help"), ("generate", "--help"), ("plan", "--help")]
)
def test_help_imports_neither_torch_nor_lightning(argv: tuple[str, ...]) -> None:
    """Before: plait sft --help imported torch (trainer.init_from) and plait generate --help the
    whole command (torch), 4-6 s on 2 cores."""
    result, imported = _imported(*argv)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "plait" in result.stdout
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("command", [("sft",), ("plan", "sft")])
def test_a_mistyped_override_is_refused_before_torch_loads(command: tuple[str, ...]) -> None:
    """Before: the train and plan commands imported the whole trainer (Lightning) before composing."""
    # optim.zzz and model.weight_decay: a typo no spelling explains, and a foreign name's move, did import
    # torch (the check of the node class's arguments, a reviewer; it is for deeper nodes only)
    result, imported = _imported(
        *command, "optim.lerning_rate=1e-4", "train.micro_batch=2", "optim.zzz=1", "model.weight_decay=0.1"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "did you mean optim.lr=1e-4?" in result.stderr and "did you mean train.micro_batch_size?" in result.stderr
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))


def test_a_sweep_refuses_a_mistyped_override_of_any_job_before_it_starts() -> None:
    """``--multirun``: each job's overrides are checked as a single run's are, naming the job (the
    sft arm of a PAFT sweep has no data.max_prompt_len); before, Hydra's raw 'Could not override ...
    use +key' came from inside the sweep, exit 1, with no 'did you mean'. Mutation: checking only
    the first job misses the dpo arm's typo below."""
    result, imported = _imported("pretrain", "--multirun", "optim.lr=1e-3,3e-4", "train.micro_batch=3")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        "did you mean train.micro_batch_size?" in result.stderr
        and "(in the sweep's job optim.lr=0.001)" in result.stderr
    )
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))
    result, _ = _imported("pretrain", "--multirun", "optim.lr=1e-3,abc", "trainer.max_steps=1")  # a bad value
    assert result.returncode == 2, result.stderr[-2000:]  # before: job 0 trained, then job 1 failed
    assert "optim.lr='abc' must be float" in result.stderr and "(in the sweep's job optim.lr=abc)" in result.stderr
    result, _ = _imported("paft", "--multirun", "paft=sft,dpo", "data.long_samples=truncate")  # sft's key only
    assert result.returncode == 2, result.stderr[-2000:]
    assert "data.long_samples=truncate: Could not override" in result.stderr and "job paft=dpo)" in result.stderr
