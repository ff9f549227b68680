"""DES-LOC: Adam on each island; parameters and the two moments averaged at their own periods.

Source: Iacob et al. 2025, "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training
Foundation Models" (arXiv 2505.22549): parameters every K_x steps, Adam's first moment every K_u,
second moment every K_v (suggested K_u = 3 K_x, K_v = 6 K_x). Local Adam, its baseline, averages
all three every K steps: the same class with the three periods equal (preset ``local_adam``).

One guard the paper does not need at its batch sizes: when the first moments are averaged without
the second, an element whose local second moment is still 0 (no gradient on this island since the
optimizer started, e.g. the embedding row of a token only other islands have seen) keeps its
zero first moment; otherwise Adam would step it by ``exp_avg / eps``. Measured on the nano model
from a warm start (2 islands of 4 x 64 tokens): 643 such embedding rows at the first K_u = 48
average, and an update of 1.4e3 on them in the next step without the guard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from strategies.local_sgd.base import IslandCost, LocalSGD, average_, local

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

MOMENTS = ("exp_avg", "exp_avg_sq")


def keeps_adam_moments(optimizer: Callable[..., torch.optim.Optimizer]) -> bool:
    """Whether optimizers built by the partial ``optimizer`` keep ``exp_avg`` and ``exp_avg_sq`` per
    parameter (Adam, AdamW, NAdam, RAdam, ...), tried on one scalar parameter. Muon is not: its
    matrices keep a momentum buffer only (its AdamW part would pass the probe)."""
    from strategies.muon import Muon  # imported here: only a DES-LOC run asks

    target = getattr(optimizer, "func", optimizer)  # the class of a Hydra partial
    if isinstance(target, type) and issubclass(target, Muon):
        return False
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    try:
        probe = optimizer([param])
        probe.step()
    except Exception:  # noqa: BLE001 - an optimizer that cannot take one plain parameter is not Adam-like
        return False
    return all(key in probe.state[param] for key in MOMENTS)


class DESLOC(LocalSGD):
    """DES-LOC (Local Adam when the three periods are equal).

    After inner step t: average the parameters over the islands if t % param_every == 0, the
    first moments if t % exp_avg_every == 0, the second moments if t % exp_avg_sq_every == 0.

    Args:
        param_every: K_x, steps between parameter averages.
        exp_avg_every: K_u for Adam's first moment (None: 3 K_x).
        exp_avg_sq_every: K_v for Adam's second moment (None: 6 K_x).

    Raises:
        ValueError: a period < 1.
        RuntimeError: at a sync, a parameter without Adam moments (the inner optimizer is not
            Adam-like, or the parameter has had no gradient yet).
    """

    def __init__(
        self, *, param_every: int = 16, exp_avg_every: int | None = None, exp_avg_sq_every: int | None = None
    ) -> None:
        super().__init__()
        self.every = {
            "param": param_every,
            "exp_avg": exp_avg_every if exp_avg_every is not None else 3 * param_every,
            "exp_avg_sq": exp_avg_sq_every if exp_avg_sq_every is not None else 6 * param_every,
        }
        names = {"param": "param_every", "exp_avg": "exp_avg_every", "exp_avg_sq": "exp_avg_sq_every"}
        for key, period in self.every.items():
            if period < 1:
                raise ValueError(f"strategy.local_sgd.{names[key]}={period} must be >= 1")

    @override
    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        problems = super().problems(run, shape)
        if run.optimizer is not None and not keeps_adam_moments(run.optimizer):
            problems.append(
                f"strategy.local_sgd={type(self).__name__} averages Adam's moments, but the inner optimizer keeps no "
                f"exp_avg/exp_avg_sq for every parameter; use optim=adamw (or strategy=diloco / strategy=hierarchical for SGD and Muon)"
            )
        return problems

    @override
    def cost(self, *, optimizer_states: int, param_bytes: int) -> IslandCost:
        """The parameters every K_x steps, the two moments every K_u and K_v (in the parameters' dtype)."""
        every = self.every
        label = f"desloc Kx={every['param']} Ku={every['exp_avg']} Kv={every['exp_avg_sq']}"
        return IslandCost(label=label, exchanged=sum(1 / period for period in every.values()))

    def run_length(self, total_steps: int) -> None:
        """Says when the run ends before its first parameter average or between two."""
        self.say(self.period_line(total_steps, self.every["param"], "param_every"))

    def sync(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        params = list(self.params.values())
        sent = average_(params, self.group) if step % self.every["param"] == 0 else 0.0
        if step % self.every["exp_avg"] == 0:
            first = [self._moment(optimizer, p, "exp_avg") for p in params]
            # An element this island has never had a gradient for has exp_avg_sq = 0: an averaged
            # first moment there would make Adam step by exp_avg / eps (embedding rows of tokens
            # only the other islands have seen: updates of ~1e3 in a small-batch run). Such an
            # element keeps its own (zero) first moment until the second moments are averaged.
            unseen = None
            if step % self.every["exp_avg_sq"] != 0:
                unseen = [local(self._moment(optimizer, p, "exp_avg_sq")) == 0 for p in params]
            sent += average_(first, self.group)
            for moment, mask in zip(first, unseen or []):
                local(moment).masked_fill_(mask, 0.0)
        if step % self.every["exp_avg_sq"] == 0:
            sent += average_([self._moment(optimizer, p, "exp_avg_sq") for p in params], self.group)
        return sent

    def _moment(self, optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.Tensor:
        state = optimizer.state.get(param, {})
        if key not in state:
            raise RuntimeError(
                f"{type(self).__name__}: the inner optimizer {type(optimizer).__name__} holds no {key} for a "
                f"parameter of shape {tuple(param.shape)}; use an Adam-family optimizer (optim=adamw)"
            )
        return state[key]
