"""The learning tier's plugin (tests/learns/plugin.py) trains the entries whose tests the session
runs, read from the collected tests' ids (under xdist the controller sees ids, not items)."""

from __future__ import annotations

from learns.plugin import _entries_of


def test_the_entries_are_read_from_the_tier_tests_ids_only() -> None:
    ids = [
        "tests/learns/test_learns.py::test_recipe_learns[dpo]",
        "tests/learns/test_learns.py::test_first_steps_equal_the_golden_curve[sft]",
        "tests/learns/test_learns.py::test_recipe_learns[sft]",
        "tests/learns/test_golden.py::test_an_unseen_base_is_named_not_passed",
        "tests/unit/test_other.py::test_something[dpo_preset]",
    ]
    assert _entries_of(ids) == ["dpo", "sft"]
    assert _entries_of(ids[3:]) == []
