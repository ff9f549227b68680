"""The combination matrix (tests/matrix.py): every recipe x strategy preset x step-changing
objective option either fails validate with a message naming the fix, or trains 2 steps equal to
one process (losses and every promised metric within 1e-5).

The default suite runs `matrix.FAST` (one combination per failure the matrix found); the whole
matrix (696 combinations, the compile option traced by aot_eager among them; more than an hour of
CPU: its 216-combination compile column alone took ~45 min on 2 cores beside other work) is a script
that prints the result table: ``OMP_NUM_THREADS=1 python tests/matrix.py``.
"""

from __future__ import annotations

import matrix
import pytest

_FIXES = ("use ", "set ", "remove ", "pad ", "lower ", "raise ")


def _assert_sound(outcome: matrix.Outcome) -> None:
    assert outcome.kind in ("equal", "refused"), f"{outcome.combo.id}: {outcome.kind}: {outcome.detail}"
    if outcome.kind == "refused":
        assert all(any(f in p for f in _FIXES) for p in outcome.detail.split(" / ")), outcome.detail


@pytest.mark.parametrize("combo_id", list(matrix.FAST))
def test_fast_subset(combo_id: str) -> None:
    combo = next(c for c in matrix.combos() if c.id == combo_id)
    outcome = matrix.check(combo)
    _assert_sound(outcome)
    assert outcome.kind == matrix.FAST[combo_id], outcome.detail
