"""Collectives on host tensors (FSDP CPU offload) run on the device the process group's backend
serves: an NCCL-only group (Lightning's on GPUs) gets them on the GPU, gloo where they are. The
backend is mocked on CPU; the gradient norm's and local SGD's collectives are recorded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import strategies.runtime.collective_device as cd
from strategies import grad_norm
from strategies.local_sgd import base

META = torch.device("meta")  # stands for "the device collective_device chose" (no GPU here)


class Recorded(Exception):
    pass


def _record(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
    raise Recorded(tensor.device)


@pytest.mark.parametrize(
    "config, expected",
    [
        ("cuda:nccl", torch.device("cuda", 0)),
        ("cpu:gloo,cuda:nccl", torch.device("cpu")),
        ("cpu:gloo,cuda:gloo", torch.device("cpu")),
    ],
)
def test_collective_device_follows_the_backend(
    monkeypatch: pytest.MonkeyPatch, config: str, expected: torch.device
) -> None:
    monkeypatch.setattr(cd.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cd.dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert cd.collective_device(None, torch.device("cpu")) == expected


def test_local_sgd_average_reduces_on_the_collective_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the host shards went to an NCCL all-reduce as they were (CPU tensors).
    chosen = []
    monkeypatch.setattr(base, "collective_device", lambda group, device: chosen.append(device) or META)
    monkeypatch.setattr(base.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(base.dist, "all_reduce", _record)
    with pytest.raises(Recorded) as seen:
        base.average_([torch.ones(3), torch.ones(2)], group=object())
    assert seen.value.args[0] == META and chosen == [torch.device("cpu")]


def test_grad_norm_reduces_over_stages_on_the_collective_device(monkeypatch: pytest.MonkeyPatch) -> None:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)
    monkeypatch.setattr(grad_norm, "collective_device", lambda group, device: META)
    monkeypatch.setattr(grad_norm.dist, "all_reduce", _record)
    with pytest.raises(Recorded) as seen:
        grad_norm.global_grad_norm([param], stage_groups=[object()])
    assert seen.value.args[0] == META
