"""C12: the DiLoCo pseudo-gradient is global - local, so the outer step moves towards the islands.

One scalar parameter, global 1.0, the islands' local values 0.7 and 0.9 (mean 0.8) after H = 1
inner step, outer SGD lr 0.7 without momentum. Expected (worked by hand from the update rule): pseudo-gradient +0.2 and
new global 1.0 - 0.7 * 0.2 = 0.86; the wrong sign gives 1.14. Sanity check: outer lr 1.0, no
momentum and one island: the new global equals the local value exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from strategies.local_sgd import DiLoCo
from strategies.runtime.gloo import run_gloo_ranks

LOCAL = {0: 0.7, 1: 0.9}


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.w = nn.Parameter(torch.tensor(1.0))


def _one_round(rank: int, *, lr: float) -> tuple[float, float]:
    model = Scalar()
    plugin = DiLoCo(sync_every=1, outer_optimizer=functools.partial(torch.optim.SGD, lr=lr))
    plugin.setup(model, group=dist.group.WORLD)
    with torch.no_grad():
        model.w.fill_(LOCAL[rank] if dist.get_world_size() > 1 else 0.8)
    plugin.after_optimizer_step(optimizer=None)
    return plugin.anchors["w"].item(), model.w.item()


def test_outer_step_moves_towards_the_islands() -> None:
    (global0, local0), (global1, local1) = run_gloo_ranks(2, functools.partial(_one_round, lr=0.7))
    assert global0 == global1 == pytest.approx(0.86, abs=1e-6)  # not 1.14
    assert local0 == local1 == global0  # every island continues from the new global value


def test_outer_lr_one_without_momentum_gives_the_local_value() -> None:
    [(global_, local)] = run_gloo_ranks(1, functools.partial(_one_round, lr=1.0))
    assert global_ == local == pytest.approx(0.8, abs=1e-7)
