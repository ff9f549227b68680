"""Hierarchical (DASO-like) data parallelism: every step inside a node, every B steps across nodes.

Source: Coquelin et al. 2022, "Accelerating neural network training with distributed asynchronous
and selective optimization (DASO)", J. Big Data 9:14 (arXiv 2104.05588). Islands (dp_replicate) are
the node groups; inside one, FSDP over dp_shard reduces gradients every step. Across them the
parameters are averaged every B steps, and every step during a synchronous warm-up. DASO's
non-blocking sends applied S steps late, its bf16 downcast and its plateau-driven choice of B are
not implemented: the global average here is blocking, in the parameters' dtype, with a fixed B.
"""

from __future__ import annotations

import torch

from strategies.local_sgd.base import LocalSGD, average_


class Hierarchical(LocalSGD):
    """Averages the parameters over the islands after every ``sync_every``-th inner step.

    Inner optimizer state stays local (any optimizer works). With sync_every = 1 and SGD
    (with momentum) this equals data parallelism over all ranks when the islands' supervised-token
    counts are equal (each island's gradient is its own token mean, averaged uniformly).

    Args:
        sync_every: B, inner steps between global parameter averages.
        warmup_steps: the first steps average after every step (DASO's synchronous warm-up).

    Raises:
        ValueError: sync_every < 1 or warmup_steps < 0.
    """

    def __init__(self, *, sync_every: int = 8, warmup_steps: int = 0) -> None:
        super().__init__()
        if sync_every < 1:
            raise ValueError(f"strategy.local_sgd.sync_every={sync_every} must be >= 1")
        if warmup_steps < 0:
            raise ValueError(f"strategy.local_sgd.warmup_steps={warmup_steps} must be >= 0")
        self.sync_every, self.warmup_steps = sync_every, warmup_steps

    def sync(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        if step <= self.warmup_steps or step % self.sync_every == 0:
            return average_(list(self.params.values()), self.group)
        return 0.0
