"""Checkpoint RNG state on GPU machines, with torch.cuda mocked on CPU: a rank saves only its
current device's CUDA state, and a checkpoint loads where fewer GPUs are visible (also one that
saved every visible GPU's state, as checkpoints did before)."""

from __future__ import annotations

import pytest
import torch

from strategies.checkpoint import dcp as ckpt


class FakeCuda:
    """``visible`` GPUs, the current one ``current``; each device's generator state is a tensor."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, visible: int, current: int) -> None:
        self.visible, self.current = visible, current
        self.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(visible)}
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "get_rng_state", self.get, raising=False)
            monkeypatch.setattr(module, "set_rng_state", self.set, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.states[i] for i in range(visible)])

    def _index(self, device: object) -> int:
        index = self.current if device in ("cuda", None) else torch.device(device).index
        index = self.current if index is None else index
        if not 0 <= index < self.visible:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def get(self, device: object = "cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set(self, state: torch.Tensor, device: object = "cuda") -> None:
        self.states[self._index(device)] = state.clone()


def test_a_rank_saves_only_its_current_device_state(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, visible=8, current=3)
    state = ckpt.rng_state()
    assert isinstance(state["cuda"], torch.Tensor)  # before: a list of all 8 devices' states
    assert torch.equal(state["cuda"], torch.full((8,), 3, dtype=torch.uint8))


def test_a_checkpoint_loads_where_fewer_gpus_are_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = ckpt.rng_state() | {"cuda": torch.full((8,), 5, dtype=torch.uint8)}
    fake = FakeCuda(monkeypatch, visible=1, current=0)
    ckpt.set_rng_state(saved)
    assert torch.equal(fake.states[0], saved["cuda"])  # into the current device


def test_a_checkpoint_of_every_visible_gpu_loads_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # The old format: get_rng_state_all() of 8 GPUs; before, set_rng_state_all raised on device 1.
    legacy = ckpt.rng_state() | {"cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]}
    fake = FakeCuda(monkeypatch, visible=2, current=1)
    ckpt.set_rng_state(legacy)
    assert torch.equal(fake.states[1], legacy["cuda"][1]) and torch.equal(
        fake.states[0], torch.zeros(8, dtype=torch.uint8)
    )
