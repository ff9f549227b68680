"""Replica groups that survive losing one: torchft's per-step quorum, fault-tolerant all-reduce and live recovery.

Each replica group is one plait world (its own processes, process group and mesh, FSDP inside
it); the groups together are the replicate axis that HSDP's ``dp_replicate`` otherwise is, but they
share no process group that one lost process could break. A torchft ``Lighthouse`` (started by
`trainer.replica_groups` for a single-machine run) forms a quorum of the groups alive; a torchft
``Manager`` in each group does the rest. Per optimizer step:

1. `reduce_tokens`, before the forward: the quorum (synchronous, ``use_async_quorum=False``; the
   groups present reconfigure torchft's gloo group when the membership changed), then one
   fault-tolerant all-reduce of the step's supervised-token count: each group divides its loss by
   the tokens of all groups present, as HSDP divides by those of all replicas.
2. Forward and backward inside the group as usual.
3. `reduce_gradients`: one fault-tolerant all-reduce (SUM) of the loss with the objective's named
   sums (per-source losses, rewards: logged over all groups) and one per gradient dtype:
   with every group present this is HSDP's gradient, bit for bit on one process per group.
4. ``should_commit``: the optimizer step runs only if every rank of the group saw its collectives
   succeed; a step whose all-reduce failed (a peer died during it) drops its update on the
   groups that saw the failure (counted: ``ft/uncommitted_steps``) and the next quorum goes on
   without the lost group.

With local SGD (strategy=ft_diloco: DiLoCo, bound through `peers`) each group is one island: no
token count or gradient crosses the groups; a quorum forms at the start of every outer round (the
first step after an outer step), and the pseudo-gradients are averaged over the groups present in
it (`average`, then ``should_commit``; a round whose average failed is dropped: the group goes back
to the global parameters). A group joining at a round's start takes the global parameters, DiLoCo's
outer state and the rest below. A group waits for the others' quorum up to ``quorum_timeout_s`` (a
restarted one until their next round starts): keep it above a round's duration.

A group that (re)starts joins at the start of training (`join`): its first quorum finds the others
ahead, torchft fetches a healthy peer's state over HTTP (this rank's shards of the model and the
optimizer, the LR schedulers, the data position, Lightning's loop counters and the task's
counters: `ReplicaGroups.state`), and the group starts its loop at the peer's step, the step the
peer is in: from then on every group holds the same parameters. A running group that falls behind
(its update dropped while the others committed) ends with an error naming the restart that
recovers it. The data: each group trains its own share of every global batch (the sampler's rank
is ``group x dp + dp_rank`` of ``groups x dp``); a lost group's share of the steps it missed is not
trained (``ft/participants`` says how many groups each step had).

Implements the FT-HSDP scheme of pytorch/torchft (``Manager``, ``ProcessGroupGloo``, ``HTTPTransport``;
the PyTorch blog "Fault Tolerant Llama", 2025) on torchft's public API, pinned to 0.2.0.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from strategies.core.local_shards import like_param, local, local_state, local_tree, placed_state
from strategies.core.parallel_dims import ParallelDims
from strategies.core.ranges import POSITIVE
from strategies.local_sgd.base import LocalSGD, allreduce_bytes_sent
from strategies.plugin import StrategyPlugin

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its Rust side logs every quorum at info
from torchft import Manager, ProcessGroupGloo  # noqa: E402 - the pinned engine (torchft==0.2.0)

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the Lighthouse's address


class FellBehind(RuntimeError):
    """A running replica group must take a peer's state mid-run (its update was dropped while the
    others committed): restarting the group recovers it (`ReplicaGroups.join`)."""


class ReplicaGroups(StrategyPlugin):
    """This world as one torchft replica group of ``num_replica_groups`` (module docstring).

    Args:
        num_replica_groups: the groups the run starts with (each one plait world of
            ``trainer.devices`` processes).
        replica_group: this world's group, ``0 .. num_replica_groups - 1`` (set by the launcher,
            `trainer.replica_groups`; None at validate before launch).
        lighthouse: the Lighthouse's address (``http://host:port``); None: ``$TORCHFT_LIGHTHOUSE``.
        min_replica_size: groups a step needs to commit its update.
        timeout_s: seconds a cross-group collective, commit or state transfer may take before the
            step fails (and its update is dropped).
        quorum_timeout_s: seconds a group waits for a quorum.
        max_restarts: the launcher's (`trainer.replica_groups`): restarts of a group that dies.
        join_timeout_s: seconds the first quorum of a fresh run waits for every group (and the
            launcher's Lighthouse for every live group before a quorum without one).
        restarted: this group was started again after it died (set by the launcher): it must
            recover from a healthy group at its first quorum, and waits for no other.

    Raises:
        ValueError: a count below 1 or ``replica_group`` outside ``0 .. num_replica_groups - 1``.
    """

    when = "setup"

    def __init__(
        self,
        *,
        num_replica_groups: int = 2,
        replica_group: int | None = None,
        lighthouse: str | None = None,
        min_replica_size: int = 1,
        timeout_s: Annotated[float, POSITIVE] = 60.0,
        quorum_timeout_s: Annotated[float, POSITIVE] = 300.0,
        max_restarts: int = 3,
        join_timeout_s: Annotated[float, POSITIVE] = 30.0,
        restarted: bool = False,
    ) -> None:
        if num_replica_groups < 1 or min_replica_size < 1:
            raise ValueError(
                f"strategy.fault_tolerance.num_replica_groups={num_replica_groups} and min_replica_size="
                f"{min_replica_size} must be at least 1"
            )
        if replica_group is not None and not 0 <= replica_group < num_replica_groups:
            raise ValueError(
                f"strategy.fault_tolerance.replica_group={replica_group} is not one of 0..{num_replica_groups - 1}"
            )
        self.num_replica_groups, self.replica_group = num_replica_groups, replica_group
        self.lighthouse, self.min_replica_size = lighthouse, min_replica_size
        self.timeout, self.quorum_timeout = timedelta(seconds=timeout_s), timedelta(seconds=quorum_timeout_s)
        self.max_restarts, self.join_timeout_s, self.restarted = max_restarts, join_timeout_s, restarted
        self.manager: Any = None
        self.trainer: Any = None
        self._quorum_ready = False  # `join` formed the first step's quorum
        self._joining = False
        self.uncommitted_steps = 0
        self.bytes_sent = 0.0
        self.participants = 0
        self.local_sgd: Any = None  # DiLoCo with one island per group (`peers`): a quorum per outer step

    def peers(self, plugins: dict[str, StrategyPlugin]) -> None:
        """Binds to the strategy's local-SGD plugin, if any: the groups are then its islands (one
        quorum per outer step, the pseudo-gradients averaged across the groups by `average`)."""
        local_sgd = plugins.get("local_sgd")
        if isinstance(local_sgd, LocalSGD):
            self.local_sgd, local_sgd.replica_groups = local_sgd, self

    # ------------------------------------------------------------------------------ validate
    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        dims = run.dims
        problems = []
        if dims.dp_replicate > 1:
            problems.append(
                f"strategy.dp_replicate={dims.dp_replicate} with strategy.fault_tolerance: the replica groups are the "
                "replicate axis (each group shards with dp_shard); use strategy.dp_replicate=1 and "
                "strategy.fault_tolerance.num_replica_groups"
            )
        for axis in ("tp", "pp", "cp"):
            if getattr(dims, axis) > 1:
                problems.append(
                    f"strategy.{axis}={getattr(dims, axis)}: strategy.fault_tolerance runs FSDP (dp_shard) inside each "
                    f"replica group so far; use strategy.{axis}=1"
                )
        # train.micro_batch_size=null resolves to all of a rank's rows (global / dp): a group's rank then
        # runs its share (global / (dp x groups)) as one micro-batch
        whole = run.micro_batch_size * dims.dp == run.global_batch_size
        per_group = dims.dp * self.num_replica_groups * (1 if whole else run.micro_batch_size)
        if run.global_batch_size % per_group:
            problems.append(
                f"train.global_batch_size={run.global_batch_size} must be a multiple of "
                f"{'' if whole else f'train.micro_batch_size={run.micro_batch_size} x '}dp={dims.dp} x "
                "strategy.fault_tolerance.num_replica_groups="
                f"{self.num_replica_groups} (each group trains its share of every batch); e.g. "
                f"train.global_batch_size={per_group * max(1, round(run.global_batch_size / per_group))}"
            )
        if run.row_kind in ("pairs", "unpaired"):
            problems.append(
                f"strategy.fault_tolerance with preference rows ({run.row_kind}): the reference log-probs and KTO's "
                "KL estimate are computed within one group so far; train the preference recipes without "
                "strategy.fault_tolerance"
            )
        if shape is not None and shape.num_experts:
            problems.append(
                "strategy.fault_tolerance with a mixture of experts: the router losses are scaled within one group "
                "so far; use a dense model"
            )
        return problems

    def active(self, dims: ParallelDims, *, islands: bool) -> bool:
        return True

    # ------------------------------------------------------------------------------ joining
    def data_share(self) -> tuple[int, int]:
        """``(index, count)`` of this world among the worlds that split each global batch."""
        return (self.replica_group or 0), self.num_replica_groups

    def join(self, trainer: Any) -> None:
        """Starts this group's torchft Manager and forms the first quorum; when the others are ahead,
        takes a healthy peer's state (`load_state`) so the loop starts at their step.

        Raises:
            RuntimeError: no replica group or Lighthouse is configured (the launcher sets both).
        """
        logging.getLogger("torchft").setLevel(logging.WARNING)  # its Manager logs every commit at info

        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if self.replica_group is None or not lighthouse:
            raise RuntimeError(
                "strategy.fault_tolerance needs strategy.fault_tolerance.replica_group and a Lighthouse "
                f"(strategy.fault_tolerance.lighthouse or ${LIGHTHOUSE_ENV}); plait's launcher sets both: run the "
                "command without strategy.fault_tolerance.replica_group"
            )
        self.trainer = trainer
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=self.timeout),
            load_state_dict=self.load_state,
            state_dict=self.state,
            min_replica_size=self.min_replica_size,
            use_async_quorum=False,  # a healing group takes the state before its forward
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=lighthouse,
            replica_id=f"plait_group_{self.replica_group}",
            init_sync=False,  # every group starts from the same seeded weights
        )
        self._joining = True
        try:
            self.manager.start_quorum(allow_heal=True)
            # A fresh run: every group trains from the first step, so the first quorum waits up to
            # join_timeout_s for the groups that start slower (a count of tries, not a clock: every
            # rank of the group sees the same quorums and so leaves the loop at the same try).
            for _ in range(0 if self.restarted else math.ceil(self.join_timeout_s / 0.5)):
                if self.manager.num_participants() >= self.num_replica_groups or self.manager.current_step() > 0:
                    break
                time.sleep(0.5)
                self.manager.start_quorum(allow_heal=True)
        finally:
            self._joining = False
        if (error := self.manager.errored()) is not None:
            raise RuntimeError(
                f"replica group {self.replica_group} could not join the others: {error.original_exception}"
            )
        if self.restarted and self.manager.current_step() == 0:
            raise RuntimeError(
                f"replica group {self.replica_group} was restarted but no healthy group was there to recover from "
                "(they finished or were lost); it does not train alone from the first step"
            )
        self._quorum_ready = True

    # ------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def reduce_tokens(self, num_tokens: torch.Tensor) -> torch.Tensor | None:
        """The step's supervised tokens over the groups present (this group's ``num_tokens`` summed
        with theirs), after the step's quorum (formed here, or by `join` for the first step)."""
        if self.local_sgd is not None:  # islands: each group's own tokens; a quorum at each round's start
            if self.trainer.global_step % self.local_sgd.sync_every == 0 and not self._quorum_ready:
                self.manager.start_quorum(allow_heal=True)
            self._quorum_ready = False
            self.participants = self.manager.num_participants()  # of this round's quorum
            return None
        if not self._quorum_ready:
            self.manager.start_quorum(allow_heal=True)
        self._quorum_ready = False
        total = num_tokens.to(torch.float64)  # exact token counts
        self.manager.allreduce(total, reduce_op=ReduceOp.SUM).wait()
        self.participants = self.manager.num_participants()
        return total.to(num_tokens.dtype)

    @torch.no_grad()
    def reduce_gradients(
        self, parameters: Sequence[nn.Parameter], loss: torch.Tensor, sums: Sequence[torch.Tensor] = ()
    ) -> tuple[torch.Tensor, bool] | None:
        """Sums the gradients (each group's already divided by the tokens of all groups), the loss
        and the named ``sums`` over the groups present, in place; whether the group may apply the
        update (``should_commit``: every collective of the step succeeded)."""
        if self.local_sgd is not None:  # islands: no gradient crosses the groups
            return None
        loss = loss.detach().clone()
        grads = [local(p.grad) for p in parameters if p.grad is not None]
        self.bytes_sent += self._all_reduce_(grads, loss=loss, sums=sums)
        return loss, self._commit()

    @torch.no_grad()
    def average(self, tensors: Sequence[torch.Tensor]) -> tuple[float, bool]:
        """Local SGD's average across the groups present (`LocalSGD.average`): each tensor (its local
        shard) replaced by its mean in this round's quorum, then ``should_commit``; returns the bytes
        this rank sent and whether every collective succeeded."""
        sent = self._all_reduce_([local(t) for t in tensors], mean=True)
        return sent, self._commit()

    def _all_reduce_(
        self,
        shards: Sequence[torch.Tensor],
        *,
        mean: bool = False,
        loss: torch.Tensor | None = None,
        sums: Sequence[torch.Tensor] = (),
    ) -> float:
        """Sums (``mean``: averages) ``shards`` over the groups present, in place: one fault-tolerant
        all-reduce per dtype, and one of the 0-dim ``loss`` with the contiguous tensors of ``sums``
        (in place, summed, not counted); returns the bytes this rank sent (ring all-reduce, as
        `allreduce_bytes_sent`)."""
        index = {d: [i for i, s in enumerate(shards) if s.dtype == d] for d in dict.fromkeys(s.dtype for s in shards)}
        messages = [torch.cat([shards[i].reshape(-1) for i in rows]) for rows in index.values()]
        small = ([loss.reshape(1)] if loss is not None else []) + [s.view(-1) for s in sums]  # one message
        scalars = [torch.cat(small)] if small else []  # (promoted to the widest dtype)
        works = [self.manager.allreduce(flat, reduce_op=ReduceOp.SUM) for flat in [*scalars, *messages]]
        for work in works:
            work.wait()
        for tensor, value in zip(small, torch.split(scalars[0], [t.numel() for t in small]) if small else ()):
            tensor.copy_(value)
        self.participants = self.manager.num_participants()
        sent = 0.0
        for flat, rows in zip(messages, index.values(), strict=True):
            if mean:
                flat.div_(self.participants)
            for i, value in zip(rows, torch.split(flat, [shards[i].numel() for i in rows])):
                shards[i].copy_(value.view_as(shards[i]))
            sent += allreduce_bytes_sent(flat.numel() * flat.element_size(), self.participants)
        return sent

    def _commit(self) -> bool:
        """``should_commit`` (every rank of the group saw the step's collectives succeed), counted when not."""
        commit = self.manager.should_commit()
        if not commit:
            self.uncommitted_steps += 1
        return commit

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        metrics = {"ft/participants": float(self.participants), "ft/uncommitted_steps": float(self.uncommitted_steps)}
        if self.local_sgd is None:  # local SGD counts its own averages' bytes
            metrics["comm/bytes_sent"] = self.bytes_sent
        return metrics

    def teardown(self) -> None:
        """Stops this group's Manager (its servers and quorum thread)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ------------------------------------------------------------------------------ live recovery
    def state(self) -> dict[str, Any]:
        """What a healing group takes from this one: this rank's shards of the model and optimizer
        state, the LR schedulers, the data position, Lightning's loop counters and the task's
        counters (tensors are this rank's live shards: torchft sends them before this step's
        update, which waits for the healing group's all-reduce)."""
        trainer = self.trainer
        task = trainer.lightning_module
        extra: dict[str, Any] = {}
        task.on_save_checkpoint(extra)
        return {
            "model": {name: local(value) for name, value in task.model.state_dict().items()},
            "optimizers": [local_state(opt.state_dict()) for opt in trainer.strategy._unwrapped_optimizers()],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "loader": trainer.train_dataloader.state_dict(),
            "loops": trainer.fit_loop.state_dict(),
            "task": extra,
            "local_sgd": local_tree(self.local_sgd.state_dict()) if self.local_sgd is not None else None,
        }

    @torch.no_grad()
    def load_state(self, state: dict[str, Any]) -> None:
        """Takes a peer's `state` (at `join`: the loop then starts at the peer's step).

        Raises:
            FellBehind: called after training started (this group's update was dropped while the
                others committed): restart the group to recover it.
        """
        if not self._joining:
            raise FellBehind(
                f"replica group {self.replica_group} fell behind the others (its update of a step was dropped while "
                "they committed); restart the group (plait's launcher does) to recover from a healthy peer"
            )
        trainer = self.trainer
        task = trainer.lightning_module
        for name, value in task.model.state_dict().items():
            local(value).copy_(state["model"][name])
        for opt, saved in zip(trainer.strategy._unwrapped_optimizers(), state["optimizers"], strict=True):
            opt.load_state_dict(placed_state(opt, saved))
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        trainer.train_dataloader.load_state_dict(state["loader"])
        trainer.fit_loop.load_state_dict(state["loops"])
        trainer.fit_loop.reset()  # as a resume from a checkpoint: the step in progress starts again
        task.on_load_checkpoint(state["task"])
        if self.local_sgd is not None:  # DiLoCo's global parameters (in place) and outer optimizer state
            saved = state["local_sgd"]
            for name, anchor in self.local_sgd.anchors.items():
                local(anchor).copy_(saved["anchor"][name])
            saved["outer"] = {
                key: {name: like_param(value, self.local_sgd.anchors[name]) for name, value in values.items()}
                for key, values in saved["outer"].items()
            }
            self.local_sgd.load_state_dict(saved)
