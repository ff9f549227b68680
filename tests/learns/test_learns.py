"""The learning tier (tests/learns/entries.py, run by tests/learns/tier.py): every recipe passes its
held-out checks, and its first steps equal the stored golden curve (for an entry started from a
base, the curve its base's end state gave: `learns.golden.golden_verdict`).

The selected entries train once per session, one at a time, in one subprocess (`tier_results`);
each test reads its entry's result. The values are printed at the end of the session, one line per entry
(tests/learns/plugin.py). A change that moves numerics on purpose rewrites the golden curves in
the same commit, with the reason in the message::

    python tests/learns/tier.py --update-golden
"""

from __future__ import annotations

import pytest

from learns.entries import ENTRIES, passed
from learns.golden import GOLDEN_RTOL, golden_verdict
from learns.tier import line

TRAINED = [name for name, entry in ENTRIES.items() if not entry.merge]


@pytest.mark.parametrize("name", list(ENTRIES))
def test_recipe_learns(tier_results: dict, name: str) -> None:
    result = tier_results[name]
    assert "error" not in result, f"{name} did not run:\n{result['error']}"
    assert passed(name, result), line(name, result)


@pytest.mark.parametrize("name", TRAINED)
def test_first_steps_equal_the_golden_curve(tier_results: dict, name: str) -> None:
    result = tier_results[name]
    assert "error" not in result, f"{name} did not run:\n{result['error']}"
    verdict, why = golden_verdict(name, tier_results)
    if verdict == "unseen base":
        pytest.skip(why)
    assert verdict == "ok", (
        f"{name}'s first steps moved (relative tolerance {GOLDEN_RTOL:g}):\n  {why}"
        + "\nIf the change is meant to move numerics, rewrite the curves in the same commit and say why in its message: "
        "python tests/learns/tier.py --update-golden"
    )
