"""Test modules have unique basenames: pytest's default import mode (tests/ has no packages) refuses
to collect a second ``test_x.py`` ("import file mismatch"), which stops the whole run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_its_own_basename() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
