"""Test modules have unique file names: pytest imports them by basename (rootdir-relative, no
packages), so a second ``test_x.py`` in another folder fails the whole suite's collection."""

from collections import Counter
from pathlib import Path


def test_test_module_names_are_unique() -> None:
    names = Counter(p.name for p in Path(__file__).parents[1].rglob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1]
