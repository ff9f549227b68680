"""`ExpertBiasUpdate`: DeepSeek-V3's auxiliary-loss-free load balancing, once per optimizer step.

Each MoE router adds a per-expert bias to its scores when it picks the top-k experts (not to the
weights). After every optimizer step the bias of an expert that received more than the mean load
goes down by ``bias_update_rate`` and that of a less loaded one goes up (Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", Algorithm 1; DeepSeek-AI
2024, "DeepSeek-V3 Technical Report", section 2.1.2). The loads are the step's routed tokens of
all micro-batches, summed over the ranks that share one gradient (one all-reduce for all blocks),
so every replica of a router moves its bias identically.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from trainer.models.moe import MoE


class ExpertBiasUpdate(L.Callback):
    """Moves every MoE router's ``expert_bias`` at each optimizer step (a no-op for dense models
    and for MoE blocks with ``bias_update_rate=0``, whose counts are just reset)."""

    @override
    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        # At the optimizer step (the step's counts are complete), so a checkpoint written at the
        # end of the step holds the moved biases.
        layers = [m for m in pl_module.model.modules() if isinstance(m, MoE)]
        if not layers:
            return
        loads_le = torch.stack([moe.router.tokens_per_expert for moe in layers])
        strategy = trainer.strategy
        strategy.all_reduce_sum(loads_le, strategy.token_axis)
        for moe, loads_e in zip(layers, loads_le):
            if moe.bias_update_rate > 0:
                moe.router.update_expert_bias(loads_e, moe.bias_update_rate)
            moe.router.tokens_per_expert.zero_()
