"""C11: DiLoCo's global parameters (the anchor) and outer momentum are in the checkpoint.

One scalar parameter, outer SGD(lr=0.7, momentum=0.9, nesterov=True), H = 2 inner steps per round,
2 islands (gloo ranks). The "inner steps" move each island's local value by a fixed amount: island
0 by 0.15 and island 1 by 0.05 per step in round 1 (mean pseudo-gradient 0.2), 0.075 and 0.025 in
round 2 (0.1). Expected (worked by hand from the update rule): global 0.734 after round 1 and 0.4876 after round 2, whether
the run is uninterrupted, checkpointed at the sync boundary (after step 2) or in the middle of the
inner loop (after step 1, where the islands' local values 0.85 and 0.95 differ). The faults give
0.601 (outer momentum lost at the boundary) and 0.767 (anchor re-snapshotted mid-round from the
local value 0.9: the case's one island, here the islands' mean).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from strategies.local_sgd import DiLoCo
from strategies.runtime.gloo import run_gloo_ranks

# Per-step decrement of each island's local value in rounds 1 and 2 (steps 1-2 and 3-4).
DECREMENT = {0: (0.15, 0.075), 1: (0.05, 0.025)}
H = 2


class Scalar(nn.Module):
    """One scalar parameter and no blocks (all parameters form DiLoCo's single fragment)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.w = nn.Parameter(torch.tensor(1.0))


def _plugin(model: nn.Module) -> DiLoCo:
    import torch.distributed as dist

    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    plugin = DiLoCo(sync_every=H, outer_optimizer=outer)
    plugin.setup(model, group=dist.group.WORLD)
    return plugin


def _rounds(rank: int, *, directory: str, checkpoint_after: int | None, fault: str | None) -> list[float]:
    """Global value after each of 4 inner steps; checkpoint after ``checkpoint_after`` and continue
    in a fresh model and plugin loaded from it (with ``fault``: the plugin state left out)."""
    model = Scalar()
    plugin = _plugin(model)
    globals_ = []
    for step in range(1, 2 * H + 1):
        with torch.no_grad():
            model.w -= DECREMENT[rank][(step - 1) // H]  # this island's inner steps
        plugin.after_optimizer_step(optimizer=None)
        globals_.append(plugin.anchors["w"].item())
        if step == checkpoint_after:
            path = Path(directory) / f"step_{step}"
            plugin.save_checkpoint(path, model=model, optimizers=[], meta={})
            model = Scalar()
            plugin = _plugin(model)
            plugin.load_checkpoint(path, model=model, optimizers=[])
            if fault == "reanchor":  # the anchor taken from the (mean) local value at the checkpoint
                plugin.anchors["w"].fill_(0.9)
            elif fault == "momentum_lost":
                plugin.outer.state.clear()
    return globals_


def rounds(tmp_path: Path, *, checkpoint_after: int | None = None, fault: str | None = None) -> list[float]:
    fn = functools.partial(_rounds, directory=str(tmp_path), checkpoint_after=checkpoint_after, fault=fault)
    by_rank = run_gloo_ranks(2, fn)
    assert by_rank[0] == by_rank[1]  # every island holds the same global value
    return by_rank[0]


def test_uninterrupted_rounds(tmp_path: Path) -> None:
    globals_ = rounds(tmp_path)
    assert globals_[1] == pytest.approx(0.734, abs=1e-6)
    assert globals_[3] == pytest.approx(0.4876, abs=1e-6)
    assert globals_[0] == 1.0 and globals_[2] == globals_[1]  # no outer step mid-round


@pytest.mark.parametrize("checkpoint_after", [1, 2], ids=["mid_round", "sync_boundary"])
def test_resume_reproduces_the_uninterrupted_rounds(tmp_path: Path, checkpoint_after: int) -> None:
    globals_ = rounds(tmp_path, checkpoint_after=checkpoint_after)
    assert globals_[1] == pytest.approx(0.734, abs=1e-6)
    assert globals_[3] == pytest.approx(0.4876, abs=1e-6)
    assert globals_ == rounds(tmp_path / "straight")  # exactly the uninterrupted trajectory


def test_the_faults_give_the_case_values(tmp_path: Path) -> None:
    # The test above can fail: without the anchor or the momentum the numbers are the case's wrong ones.
    assert rounds(tmp_path / "a", checkpoint_after=2, fault="momentum_lost")[3] == pytest.approx(0.601, abs=1e-6)
    assert rounds(tmp_path / "b", checkpoint_after=1, fault="reanchor")[1] == pytest.approx(0.767, abs=1e-6)
