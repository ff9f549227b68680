"""DASO's plateau-driven period and delay (strategies.local_sgd.hierarchical), and its settings' checks."""

from __future__ import annotations

import pytest

from strategies.local_sgd.hierarchical import Hierarchical, Plateau


def test_a_plateau_is_patience_windows_without_a_relative_improvement() -> None:
    plateau = Plateau(patience=2, threshold=0.05)  # heat: a plateau once the bad windows exceed patience
    assert [plateau.stalled(x) for x in (4.0, 3.0, 2.9, 2.95, 2.96, 2.0, 1.99, 1.98, 1.97)] == [
        False, False, False, False, True, False, False, False, True,
    ]  # fmt: skip


def test_plateaus_halve_the_period_then_reset_it_as_heat_does() -> None:
    daso = Hierarchical(sync_every=4, delay=1, adaptive=True, max_sync_every=8, patience=1, stability=0.05)
    trajectory = []
    for loss in (3.0, 2.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.0):
        daso.adapt(loss)
        trajectory.append((daso.sync_every, daso.delay))
    assert trajectory == [
        (4, 1), (4, 1), (4, 1), (4, 1),  # improving, then the first flat window
        (2, 1), (2, 1), (1, 1), (1, 1),  # patience 1: a plateau every second flat window; B halves, S stays >= 1
        (8, 2), (8, 2), (8, 2),  # at B = 1: reset to max_sync_every and max_sync_every // 4
    ]  # fmt: skip


def test_the_delay_never_exceeds_the_halved_period() -> None:
    daso = Hierarchical(sync_every=8, delay=8, adaptive=True, patience=0)
    for loss in (1.0, 1.0):  # the second window is a plateau
        daso.adapt(loss)
    assert (daso.sync_every, daso.delay) == (4, 4)


def test_a_blocking_run_stays_blocking() -> None:
    daso = Hierarchical(sync_every=2, delay=0, adaptive=True, max_sync_every=8, patience=1)
    for loss in (1.0, 1.0, 1.0, 1.0):
        daso.adapt(loss)
    assert daso.delay == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sync_every": 2, "delay": 3}, "delay=3 is above sync_every=2"),
        ({"global_dtype": "fp16"}, "global_dtype='fp16' is unknown"),
        ({"plateau_every": 0}, "plateau_every=0 must be >= 1"),
    ],
)
def test_bad_settings_name_the_key(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Hierarchical(**settings)


def test_a_skipped_non_finite_step_stays_out_of_the_window_and_the_checkpoint() -> None:
    import torch

    from strategies.checkpoint.finite import non_finite_entry

    daso = Hierarchical(adaptive=True, plateau_every=50)
    for step, loss in enumerate((3.0, float("nan"), 5.0), start=1):
        daso.observe_loss(step, torch.tensor(loss))
    state = daso.state_dict()
    assert (state["window_sum"], state["window_steps"]) == (8.0, 2)
    assert non_finite_entry({"local_sgd": state}) is None


def test_a_resume_takes_the_configs_period_unless_the_plateau_rule_set_it() -> None:
    """strategy=hierarchical resumed with another sync_every kept the checkpoint's (said at launch,
    recorded, then ignored); DASO's adaptive period is the plateau rule's state and is restored."""
    from torch import nn

    saved = Hierarchical(sync_every=8, delay=2)
    saved.setup(nn.Linear(2, 2), group=None)
    fixed = Hierarchical(sync_every=2, delay=1)
    fixed.setup(nn.Linear(2, 2), group=None)
    fixed.load_state_dict(saved.state_dict())
    assert (fixed.sync_every, fixed.delay) == (2, 1)
    adaptive = Hierarchical(sync_every=2, delay=1, adaptive=True)
    adaptive.setup(nn.Linear(2, 2), group=None)
    adaptive.load_state_dict(saved.state_dict())
    assert (adaptive.sync_every, adaptive.delay) == (8, 2)
