"""The code stays formatted: ``ruff format`` and ruff's import order (pyproject.toml ``[tool.ruff]``).

ruff is a dev dependency (pinned): a missing one fails here instead of skipping. To fix a failure,
run ``ruff format . && ruff check --select I --fix .`` from the repo root.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_code_is_formatted() -> None:
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout[-3000:]}{result.stderr[-2000:]}"


def test_imports_are_sorted() -> None:
    result = _ruff("check", "--select", "I", ".")
    assert result.returncode == 0, (
        f"run `ruff check --select I --fix .`:\n{result.stdout[-3000:]}{result.stderr[-2000:]}"
    )
