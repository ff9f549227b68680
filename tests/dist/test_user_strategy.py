"""The subclassing contract (README, "Your own strategy"): a user's MeshStrategy subclass overrides one method
and is selected with ``strategy._target_``; it trains, and its overrides run in every rank.

The run also switches on activation checkpointing and per-block compile through the preset's
plugin nodes, so the same fit checks that `MeshStrategy.parallelize` applies them (and FSDP
after them), and that the losses equal a plain one-process run.
"""

from __future__ import annotations

from typing import Any

import torch
from harness import compose_config, fit, losses
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from strategies.activation_checkpoint import is_checkpointed
from strategies.mesh import MeshStrategy
from trainer.config import validate


class LoggingStrategy(MeshStrategy):
    """Records what `parallelize` built and every optimizer step, into the Task's history."""

    def __init__(self, *args: Any, tag: str = "user", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag

    @override
    def parallelize(self, model: nn.Module) -> None:
        super().parallelize(model)
        blocks = list(model.layers.values())
        self.lightning_module.history.append(
            {
                "tag": self.tag,
                "rank": self.global_rank,
                "checkpointed": [is_checkpointed(b) for b in blocks],
                "compiled": [b._compiled_call_impl is not None for b in blocks],
                "sharded": [isinstance(b, FSDPModule) for b in blocks] + [isinstance(model, FSDPModule)],
            }
        )

    @override
    def after_optimizer_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        self.lightning_module.history.append({"after_step": step, "world": self.world_size})
        return super().after_optimizer_step(model, step, optimizer)


def test_user_subclass_selected_by_target_trains_and_its_overrides_run(tmp_path) -> None:
    cfg = compose_config(
        [
            "strategy=fsdp",
            "trainer.devices=2",
            f"strategy._target_={__name__}.LoggingStrategy",
            "+strategy.tag=mine",  # the subclass's signature is the schema: its own arguments are overrides too
            "strategy.activation_checkpoint.mode=full",
            "strategy.compile.enabled=true",
            "strategy.compile.backend=aot_eager",  # traced and partitioned, no C++ build (seconds, not a minute)
            "optim=sgd",
        ]
    )
    validate(cfg)
    trainer, task = fit(cfg, tmp_path / "user")
    assert type(trainer.strategy) is LoggingStrategy
    built = [h for h in task.history if "tag" in h]
    assert built == [
        {
            "tag": "mine",
            "rank": 0,
            "checkpointed": [True, True],
            "compiled": [True, True],
            "sharded": [True, True, True],  # both blocks and the root
        }
    ]
    assert [h["after_step"] for h in task.history if "after_step" in h] == [1, 2, 3]
    assert {h["world"] for h in task.history if "world" in h} == {2}

    _, reference = fit(compose_config(["strategy=ddp", "trainer.devices=1", "optim=sgd"]), tmp_path / "ref")
    torch.testing.assert_close(losses(task.history), losses(reference.history), rtol=0, atol=1e-5)
    assert len(losses(task.history)) == 3
