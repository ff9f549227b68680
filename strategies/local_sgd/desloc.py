"""DES-LOC: Adam on each island; parameters and the two moments averaged at their own periods.

Source: Iacob et al. 2025, "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training
Foundation Models" (arXiv 2505.22549): parameters every K_x steps, Adam's first moment every K_u,
second moment every K_v (suggested K_u = 3 K_x, K_v = 6 K_x). Local Adam, its baseline, averages
all three every K steps: the same class with the three periods equal (preset ``local_adam``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from strategies.local_sgd.base import LocalSGD, average_

if TYPE_CHECKING:
    from strategies.resolved import ResolvedRun
    from strategies.shape import ModelShape

MOMENTS = ("exp_avg", "exp_avg_sq")


def keeps_adam_moments(optimizer: Callable[..., torch.optim.Optimizer]) -> bool:
    """Whether optimizers built by the partial ``optimizer`` keep ``exp_avg`` and ``exp_avg_sq`` per
    parameter (Adam, AdamW, NAdam, RAdam, ...), tried on one scalar parameter."""
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
                f"exp_avg/exp_avg_sq; use optim=adamw (or strategy=diloco / strategy=hierarchical for SGD)"
            )
        return problems

    def sync(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        params = list(self.params.values())
        sent = average_(params, self.group) if step % self.every["param"] == 0 else 0.0
        for key in MOMENTS:
            if step % self.every[key] == 0:
                sent += average_([self._moment(optimizer, p, key) for p in params], self.group)
        return sent

    def _moment(self, optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.Tensor:
        state = optimizer.state.get(param, {})
        if key not in state:
            raise RuntimeError(
                f"{type(self).__name__}: the inner optimizer {type(optimizer).__name__} holds no {key} for a "
                f"parameter of shape {tuple(param.shape)}; use an Adam-family optimizer (optim=adamw)"
            )
        return state[key]
