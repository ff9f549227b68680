"""DASO: every step inside a node, every B steps across nodes, non-blocking, applied S steps late.

Source: Coquelin et al. 2022, "Accelerating neural network training with distributed asynchronous
and selective optimization (DASO)", J. Big Data 9:14 (arXiv 2104.05588), and the authors'
implementation (``heat.optim.DASO`` in helmholtz-analytics/heat: ``_gs_send_params``,
``_gs_rcv_update_params``, ``epoch_loss_logic``). Islands (dp_replicate) are the node groups;
inside one, FSDP over dp_shard reduces gradients every step. Across them:

- **global synchronisation every B steps**, each step during a synchronous warm-up;
- **non-blocking, S steps late** (``delay``): the islands' parameters are summed by an
  asynchronous all-reduce started after the sending step; S steps later each island merges the
  sum Σ (of the P islands' parameters as sent) with its current parameters x as
  ``x <- (2S x + Σ) / (P + 2S)`` (the paper's weighting of the local, newer parameters against the
  stale average). S = 0 is a blocking average, ``x <- Σ / P``;
- **low-precision messages** (``global_dtype``): the parameters travel (and are summed) in bf16;
- **plateau-driven B and S** (``adaptive``): every ``plateau_every`` steps the mean training loss
  of that window (the token-weighted loss of all islands: every rank sees the same value, so
  every rank takes the same decision) is tested for a plateau (no relative improvement of
  ``stability`` over the best for more than ``patience`` windows). On a plateau B halves and S drops by one
  (at least 1); at B = 1 a plateau resets B to ``max_sync_every`` and S to ``max_sync_every // 4``
  (heat's ``epoch_loss_logic``: the loss stalls, so the islands synchronise more often, until the
  cycle starts again). The warm-up keeps B = 1, S = 0;
- **synchronous warm-up and cool-down**: the first ``warmup_steps`` and the last ``cooldown_steps``
  (of ``total_steps``) synchronise after every step, blocking, so the run ends on one model.

A message in flight when a checkpoint is written is waited for and its sum saved, so a resumed run
merges it at the same step as an uninterrupted one. Bytes: a message of ``n`` elements counts
``allreduce_bytes_sent(n * itemsize(global_dtype), P)`` (base.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from strategies.local_sgd.base import IslandCost, LocalSGD, allreduce_bytes_sent, flat_messages, local

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Plateau:
    """The loss-plateau test: no relative improvement of ``threshold`` over the best loss for more
    than ``patience`` consecutive windows (heat's ``DetectMetricPlateau`` in "min" mode).

    Args:
        patience: windows without improvement allowed; one more makes a plateau.
        threshold: relative improvement that counts (0.05: 5% below the best).
    """

    def __init__(self, *, patience: int = 2, threshold: float = 0.05) -> None:
        self.patience, self.threshold = patience, threshold
        self.best, self.bad = float("inf"), 0

    def stalled(self, loss: float) -> bool:
        """Records one window's ``loss``; True on a plateau (the count of bad windows then restarts)."""
        if loss < self.best * (1.0 - self.threshold):
            self.best, self.bad = loss, 0
            return False
        self.bad += 1
        if self.bad > self.patience:  # heat: num_bad_epochs > patience
            self.bad = 0
            return True
        return False


class Hierarchical(LocalSGD):
    """DASO across the islands: parameters summed every B steps, merged S steps later.

    Inner optimizer state stays local (any optimizer works). With B = 1, S = 0, fp32 messages and
    SGD (with momentum) this equals data parallelism over all ranks when the islands' supervised-token
    counts are equal (each island's gradient is its own token mean, averaged uniformly).

    Args:
        sync_every: B, inner steps between global synchronisations (counted from the last one).
        warmup_steps: the first steps synchronise after every step, blocking (DASO's warm-up).
        cooldown_steps: the last steps (of ``total_steps``) do too (DASO's cool-down).
        total_steps: the steps ``cooldown_steps`` counts back from; None (the presets): the run's
            planned steps, as the LR schedule spans them (`run_length`: ``trainer.max_steps``, or
            fewer when the data ends first).
        delay: S, steps between a synchronisation's send and its merge; 0: blocking.
        global_dtype: dtype of the global messages, "fp32" or "bf16" (the paper's downcast).
        adaptive: change B and S at loss plateaus (see the module docstring).
        max_sync_every: B after a plateau at B = 1 (S becomes ``max_sync_every // 4``, at least 1).
        plateau_every: steps per window of the plateau test.
        patience: windows without improvement allowed; one more makes a plateau.
        stability: relative improvement of the window loss that counts.

    Raises:
        ValueError: a count below its minimum, ``delay > sync_every`` (two messages would be in
            flight) or an unknown ``global_dtype``.
    """

    def __init__(
        self,
        *,
        sync_every: int = 8,
        warmup_steps: int = 0,
        cooldown_steps: int = 0,
        total_steps: int | None = None,
        delay: int = 0,
        global_dtype: Literal["fp32", "bf16"] = "fp32",
        adaptive: bool = False,
        max_sync_every: int = 8,
        plateau_every: int = 50,
        patience: int = 2,
        stability: float = 0.05,
    ) -> None:
        super().__init__()
        for key, value, least in (
            ("sync_every", sync_every, 1), ("warmup_steps", warmup_steps, 0), ("delay", delay, 0),
            ("cooldown_steps", cooldown_steps, 0),
            ("max_sync_every", max_sync_every, 1), ("plateau_every", plateau_every, 1), ("patience", patience, 0),
        ):  # fmt: skip
            if value < least:
                raise ValueError(f"strategy.local_sgd.{key}={value} must be >= {least}")
        if delay > sync_every:
            raise ValueError(
                f"strategy.local_sgd.delay={delay} is above sync_every={sync_every}: a synchronisation would start "
                f"before the last one is merged; use a delay of at most sync_every"
            )
        if global_dtype not in DTYPES:
            raise ValueError(
                f"strategy.local_sgd.global_dtype={global_dtype!r} is unknown; use one of {sorted(DTYPES)}"
            )
        self.sync_every, self.warmup_steps, self.delay = sync_every, warmup_steps, delay
        self.cooldown_steps, self.total_steps = cooldown_steps, total_steps
        self.global_dtype, self.adaptive, self.max_sync_every = global_dtype, adaptive, max_sync_every
        self.plateau_every = plateau_every
        self.plateau = Plateau(patience=patience, threshold=stability)
        self.since_sync = 0  # inner steps since the last send (or the warm-up's end)
        # This window's finite step losses, summed in step order in float64 and counted, on the loss's device
        # (read to the host once per window; a resumed run continues the same sum, so it is bitwise the same).
        self.window_sum: torch.Tensor | float = 0.0
        self.window_steps: torch.Tensor | int = 0
        # A message in flight: (merge step, its delay, the all-reduce's work, [(flat sum, params)]), or
        # one restored from a checkpoint: sums by parameter name, already received.
        self.in_flight: tuple[int, int, Any, list[tuple[torch.Tensor, list[str]]]] | None = None

    # ------------------------------------------------------------------------------ the algorithm
    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """Adds step ``step``'s training loss (every island's token-weighted mean) to the plateau window;
        a non-finite loss (a step the non-finite guard skipped) is left out."""
        if self.adaptive and step > self.warmup_steps:
            loss = loss.detach().reshape(()).double()
            finite = torch.isfinite(loss)
            self.window_sum = self.window_sum + torch.where(finite, loss, torch.zeros_like(loss))
            self.window_steps = self.window_steps + finite.long()

    def cost(self, *, optimizer_states: int, param_bytes: int) -> IslandCost:
        """The parameters every B steps in ``global_dtype``, under the next S steps' compute when S > 0,
        with its flat sum kept while in flight. B and S as configured (``adaptive`` changes them)."""
        share = DTYPES[self.global_dtype].itemsize / param_bytes
        label = f"daso B={self.sync_every} S={self.delay}" + (" adaptive" if self.adaptive else "")
        return IslandCost(
            label=label, exchanged=share / self.sync_every, kept=share if self.delay else 0.0, overlapped=self.delay > 0
        )

    def kept_tensors(self) -> list[torch.Tensor]:
        """The flat sums of a message in flight (`cost`'s ``kept``); none between messages."""
        return [flat for flat, _ in self.in_flight[3]] if self.in_flight is not None else []

    def run_length(self, total_steps: int) -> None:
        """The run's planned steps: the cool-down's ``total_steps`` unless the config set it. Without a
        cool-down, says when the islands end apart: the run ends between two synchronisations, a
        late merge (``delay``) is still to come, or the period follows the loss (``adaptive``)."""
        if self.total_steps is None:
            self.total_steps = total_steps
        after = total_steps - self.warmup_steps  # the steps after the warm-up, synchronised every sync_every
        if self.cooldown_steps or after <= 0:
            return
        if not self.delay and not self.adaptive:
            if after % self.sync_every:
                warmup = f" after strategy.local_sgd.warmup_steps={self.warmup_steps}" if self.warmup_steps else ""
                self.say(
                    f"warning: the run's {total_steps} planned steps end {after % self.sync_every} after its last "
                    f"synchronisation (every strategy.local_sgd.sync_every={self.sync_every} steps{warmup}): the islands "
                    "end apart (the last evaluation and the checkpoint hold each island's own weights); choose "
                    f"trainer.max_steps as {self.warmup_steps} plus a multiple of {self.sync_every}, or set "
                    "strategy.local_sgd.cooldown_steps"
                )
            return
        why = "the period follows the loss (adaptive)" if self.adaptive else f"a sum is merged {self.delay} steps late"
        self.say(
            f"warning: {why} and strategy.local_sgd.cooldown_steps=0, so the run's {total_steps} planned steps end with "
            "the islands apart (the last evaluation and the checkpoint hold each island's own weights; a sum still in "
            "flight is not merged); set strategy.local_sgd.cooldown_steps (the last steps synchronise after every "
            "step, blocking: strategy=daso sets 20)"
        )

    @property
    def cooldown_from(self) -> float:
        """The first step of the cool-down (inf without one).

        Raises:
            RuntimeError: a cool-down whose ``total_steps`` was neither set nor told (`run_length`).
        """
        if not self.cooldown_steps:
            return float("inf")
        if self.total_steps is None:
            raise RuntimeError(
                "strategy.local_sgd.cooldown_steps: the run's length was not told (run_length); set total_steps"
            )
        return self.total_steps - self.cooldown_steps + 1

    def sync(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        if self.in_flight is not None and self.in_flight[0] == step:
            self._merge()
        if step <= self.warmup_steps or step >= self.cooldown_from:
            return self._send(step, delay=0)
        self._adapt(step)
        self.since_sync += 1
        if self.since_sync >= self.sync_every:
            self.since_sync = 0
            return self._send(step, delay=self.delay)
        return 0.0

    def _adapt(self, step: int) -> None:
        """At a window's end, `adapt` to the window's mean loss."""
        if not self.adaptive or (step - self.warmup_steps) % self.plateau_every:
            return
        total, count = float(self.window_sum), int(self.window_steps)
        self.window_sum, self.window_steps = 0.0, 0
        if count:  # a window whose every step was skipped says nothing of the trend
            self.adapt(total / count)

    def adapt(self, window_loss: float) -> None:
        """One window's plateau test (``window_loss``: its mean training loss) and the change of B
        and S it calls for (heat's ``epoch_loss_logic``): on a plateau B halves and S drops by one
        (at least 1), and at B = 1 they reset to ``max_sync_every`` and ``max_sync_every // 4``.
        A blocking run (S = 0) stays blocking."""
        if not self.plateau.stalled(window_loss):
            return
        if self.sync_every > 1:
            self.sync_every //= 2
            self.delay = max(self.delay - 1, 1) if self.delay else 0
        else:
            self.sync_every = self.max_sync_every
            self.delay = max(self.max_sync_every // 4, 1) if self.delay else 0
        self.delay = min(self.delay, self.sync_every)  # a halved B may not wait longer than it sends
        self.since_sync = min(self.since_sync, self.sync_every - 1)

    @torch.no_grad()
    def _send(self, step: int, *, delay: int) -> float:
        """Sums the islands' parameters in ``global_dtype``: merged now (``delay`` 0) or at ``step + delay``
        (a message still in flight is merged first: the cool-down may start before it is due)."""
        if self.in_flight is not None:
            self._merge()
        names = list(self.params)
        shards = [local(self.params[n]) for n in names]
        groups = [
            (flat, [names[i] for i in index])
            for flat, index in flat_messages(shards, self.group, DTYPES[self.global_dtype])
        ]
        # Started without blocking either way: a blocking synchronisation (delay 0) is merged, waiting, at once.
        works = [dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True) for flat, _ in groups]
        self.in_flight = (step + delay, delay, works, groups)
        if delay == 0:
            self._merge()
        return sum(allreduce_bytes_sent(flat.numel() * flat.element_size(), self.num_islands) for flat, _ in groups)

    @torch.no_grad()
    def _merge(self) -> None:
        """``x <- (2S x + sum) / (P + 2S)`` for the message in flight (S its delay; 0: the mean)."""
        delay = self.in_flight[1]
        weight = 2.0 * delay
        for name, total in self._received().items():
            shard = local(self.params[name])
            shard.copy_((weight * shard.double() + total.to(shard.device).double()) / (self.num_islands + weight))
        self.in_flight = None

    def _received(self) -> dict[str, torch.Tensor]:
        """The message in flight's sums by parameter name, shaped like this rank's shards (waited for)."""
        merge_step, delay, works, groups = self.in_flight
        for work in works or ():
            work.wait()
        self.in_flight = (merge_step, delay, None, groups)
        sums = {}
        for flat, names in groups:
            for name, total in zip(names, torch.split(flat, [local(self.params[n]).numel() for n in names])):
                sums[name] = total.view_as(local(self.params[name]))
        return sums

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self, saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Counters, B and S, the plateau test, the window's losses and a message in flight (waited
        for, its sum by parameter name, sharded like the parameter)."""
        state = super().state_dict()
        state.update(
            sync_every=self.sync_every, delay=self.delay, since_sync=self.since_sync,
            seen=int(math.isfinite(self.plateau.best)), bad=self.plateau.bad,
            best=self.plateau.best if math.isfinite(self.plateau.best) else 0.0,  # a checkpoint holds no inf
            window_sum=float(self.window_sum), window_steps=int(self.window_steps),
        )  # fmt: skip
        pending: dict[str, torch.Tensor] = {}
        if saved is not None:  # a fresh run loading: allocate the sums the checkpoint holds
            dtype = DTYPES[self.global_dtype]
            for entry in saved:
                if entry.startswith("pending."):
                    name = entry[len("pending.") :]
                    pending[name] = torch.zeros_like(self.params[name], dtype=dtype)
            state["pending_step"] = state["pending_delay"] = 0
        elif self.in_flight is not None:
            for name, total in self._received().items():
                pending[name] = torch.zeros_like(self.params[name], dtype=total.dtype)
                local(pending[name]).copy_(total)
            state["pending_step"], state["pending_delay"] = self.in_flight[0], self.in_flight[1]
        else:
            state["pending_step"] = state["pending_delay"] = 0
        state["pending"] = pending
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if (
            self.adaptive
        ):  # the period and delay the plateau rule had reached; else the config's (a resume may change them)
            self.sync_every, self.delay = int(state["sync_every"]), int(state["delay"])
        self.since_sync = min(int(state["since_sync"]), self.sync_every - 1)
        self.plateau.best = float(state["best"]) if int(state["seen"]) else float("inf")
        self.plateau.bad = int(state["bad"])
        self.window_sum, self.window_steps = float(state["window_sum"]), int(state["window_steps"])
        self.in_flight = None
        if int(state["pending_step"]):
            names = list(state["pending"])
            flat = torch.cat([local(state["pending"][n]).reshape(-1) for n in names])
            self.in_flight = (int(state["pending_step"]), int(state["pending_delay"]), None, [(flat, names)])
