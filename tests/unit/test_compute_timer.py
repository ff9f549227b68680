"""The balance telemetry's compute timer (strategies/runtime/compute_timer.py) inside MeshStrategy's step:
forward/backward seconds up to the gradient sync, the last backward (where it waits) left out."""

from __future__ import annotations

import time

import torch
from torch.distributed.fsdp import FSDPModule

from strategies.mesh import MeshStrategy


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[bool] = []

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.syncs.append(sync)


def _sharded() -> _Model:
    """A `_Model` whose class is swapped as ``fully_shard`` swaps it (an FSDPModule), recording its syncs."""
    model = _Model()
    model.__class__ = type("FSDP_Model", (_Model, FSDPModule), {})
    return model


def test_timer_counts_forward_and_backward_up_to_the_gradient_sync(monkeypatch):
    strategy = MeshStrategy()
    monkeypatch.setattr(MeshStrategy, "root_device", property(lambda self: torch.device("cpu")))
    model = _sharded()

    def loss_fn(model, micro_batch):
        time.sleep(0.05)
        return torch.ones(())

    def backward(loss):
        time.sleep(0.3 if model.syncs[-1] else 0.1)  # the synchronising backward: waits for the others

    micro_batches = [{"input_ids": torch.zeros(1, 4)} for _ in range(3)]
    strategy._forward_backward(model, micro_batches, loss_fn, backward)
    assert strategy.compute_timer.seconds == 0.0  # off unless the telemetry switches it on
    strategy.compute_timer.enabled = True
    start = time.perf_counter()
    strategy._forward_backward(model, micro_batches, loss_fn, backward)
    whole = time.perf_counter() - start
    # 3 forwards (0.05) + 2 backwards without sync (0.1); the last backward (0.3) is left out
    assert 0.35 <= strategy.compute_timer.seconds < 0.35 + 0.25 < whole
    assert model.syncs[-3:] == [False, False, True]
