"""Asynchronous saves on 2 gloo ranks under FSDP2: the checkpoint a background save writes (its
shards from both ranks, each rank's RNG state, meta.pt) loads to the state a synchronous save of
the same moment loads to, though the live weights change during the write; the ranks agree that
the write is done (`AsyncWriter.all_written`) before it is sealed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.async_save import AsyncWriter
from strategies.runtime.gloo import run_gloo_ranks


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_both(root: Path) -> Any:
    def rank_fn(rank: int) -> list[bool]:
        model, _ = _model(0)
        mesh = init_device_mesh("cpu", (2,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(2, 8) * (rank + 1)).sum().backward()
        optimizer.step()
        meta = {"global_step": 1}
        torch.manual_seed(7 + rank)
        ckpt.save(root / "sync", model=model, optimizers=[optimizer], meta=meta)
        torch.manual_seed(7 + rank)
        writer = AsyncWriter()
        ckpt.save(root / "async", model=model, optimizers=[optimizer], meta=meta, writer=writer)
        with torch.no_grad():  # the next steps change the live shards during the write
            for p in model.parameters():
                p.add_(1.0)
        answers = []
        while not answers or not answers[-1]:  # one agreement per step, as the callback asks
            writer.begin_poll()
            time.sleep(0.05)
            answers.append(writer.all_written())
        complete_before = ckpt.is_checkpoint(root / "async")
        writer.finish()
        writer.close()
        return [complete_before, ckpt.is_checkpoint(root / "async")]

    return run_gloo_ranks(2, rank_fn)


def _loaded(path: Path) -> dict[str, Any]:
    model, optimizer = _model(1)  # other values: all that is compared comes from the checkpoint
    meta = ckpt.load(path, model=model, optimizers=[optimizer])
    rngs = [torch.load(path / "rng" / f"rank_{r:05d}.pt", weights_only=True) for r in range(2)]
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"], "rng": rngs, "meta": meta}


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}.{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_background_save_on_two_ranks_loads_as_a_synchronous_one(tmp_path: Path) -> None:
    assert _save_both(tmp_path) == [[False, True], [False, True]]  # sealed only by finish, on every rank
    assert ckpt.verify_checkpoint(tmp_path / "async") is None
    assert sorted(p.name for p in (tmp_path / "async").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    _assert_same(_loaded(tmp_path / "async"), _loaded(tmp_path / "sync"))
