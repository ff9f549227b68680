"""Independent Subnet Training (IST): each island trains a disjoint part of every MLP's hidden units.

Source: Yuan, Wolfe, Dun, Tang, Kyrillidis, Jermaine 2022, "Distributed Learning of Fully Connected
Neural Networks using Independent Subnet Training" (PVLDB 15(8)); the authors' code
(BinhangYuan/IST_Release: ``partition_to_list``, ``flush``). Each round of ``sync_every`` (L) local
steps, the hidden units of every SwiGLU MLP are split at random into P disjoint groups of F / P
(P = the islands; one permutation per MLP, drawn from a generator seeded by (``split_seed``, round),
the same on every island). Island i keeps only its group: the gate/up rows (w1, w3, and their
biases) and the down-projection columns (w2) of its units, as narrow tensors (the same
``nn.Parameter`` objects, ``p.data`` replaced: the optimizer keeps its references), and trains that
narrow subnet on its own rows. Everything else (attention, norms, embeddings, head, w2's bias) is
trained by every island, as in local SGD. At the end of a round the islands reassemble: each
island's units go back to their places in the full matrices (one all-gather), the shared
parameters are averaged (`average_`), and the next round draws a new split.

Optimizer state: a unit's state tensors (Adam's moments) travel with it. They are sliced with the
parameter at the split and gathered with it at the reassembly, so each unit continues with its own
moments whichever island trains it next, and the full state is there for a checkpoint (resetting
them each round would restart Adam every L steps). Scalars (Adam's ``step``) are shared.

Output scaling: the reference code does not rescale a narrow subnet's output (its networks
normalise every layer's output with BatchNorm, which absorbs it). A transformer's MLP output goes
into the residual stream unnormalised, and the full MLP sums P subnets' outputs, so
``scale_output=True`` (the default) multiplies the narrow MLP's output by P while it trains
(inverted dropout with keep rate 1 / P): the reassembled MLP is then the mean of the subnets' MLPs.
Measured on the pretrain recipe's sizes (docs/benchmarks.md): 400 steps at 2 islands end at 1.047 x
DDP's validation loss with it, 1.064 without. ``scale_output=False`` is the paper's.

Bytes: the shared parameters' average counts as a ring all-reduce (base.py); the all-gather as a
ring all-gather: each rank sends its message to the P - 1 others, ``(P - 1) x`` its bytes
(`allgather_bytes_sent`). Checkpoints are written in the full shape (a save in the middle of a round
gathers the units first, without counting: that is checkpoint traffic, not the algorithm's); a
resumed round redraws its split and slices the loaded full tensors, bitwise what it had.

Scope: whole models per island (dp_shard = tp = cp = pp = 1), dense SwiGLU MLPs (no mixture of
experts), no LoRA, Mixout, SAT, Muon, compile or float8 (all refused by validate). Attention heads are not split (IST here
splits MLP units only).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from strategies.checkpoint.async_save import AsyncWriter
from strategies.local_sgd.base import IslandCost, LocalSGD, average_, flat_messages
from strategies.local_sgd.units import SwiGLU, split_units, unit_params, unit_state, widen, widened
from strategies.muon import Muon

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


def allgather_bytes_sent(num_bytes: int, num_ranks: int) -> float:
    """Bytes each rank sends in a ring all-gather where every rank contributes ``num_bytes``."""
    return float((num_ranks - 1) * num_bytes)


class IST(LocalSGD):
    """Independent Subnet Training on the islands (see the module docstring).

    The split is applied at the start of a round's first step (`step_context`), so between a
    reassembly and the next step (validation, a checkpoint, the end of training) every island
    holds the full model.

    Args:
        sync_every: L, local steps per round (between two reassemblies).
        split_seed: seed of the random splits (round r draws from (split_seed, r)).
        scale_output: multiply a narrow MLP's output by P while it trains (see the module docstring).

    Raises:
        ValueError: sync_every < 1.
    """

    conflicts = ("mixout", "sat")  # Mixout's anchors and SAT's channels are full-width MLP tensors

    def __init__(self, *, sync_every: int = 10, split_seed: int = 0, scale_output: bool = True) -> None:
        super().__init__()
        if sync_every < 1:
            raise ValueError(f"strategy.local_sgd.sync_every={sync_every} must be >= 1")
        self.sync_every, self.split_seed, self.scale_output = sync_every, split_seed, scale_output
        self.round = 0  # reassemblies done: the split of the current round is drawn from (split_seed, round)
        self.mlps: list[SwiGLU] = []
        self.shared: list[nn.Parameter] = []
        self.groups: list[list[torch.Tensor]] | None = None  # [mlp][island] while narrow; None: full
        self.optimizer: torch.optim.Optimizer | None = None  # the inner optimizer, once seen
        self._hooks: list[Any] = []
        self.float8: Any = None  # the strategy's float8 plugin (`peers`): its Linear layers are not plain ones

    @override
    def peers(self, plugins: dict[str, Any]) -> None:
        self.float8 = plugins.get("float8")

    # ------------------------------------------------------------------------------ validate
    @override
    def cost(self, *, optimizer_states: int, param_bytes: int) -> IslandCost:
        """Once per round of L steps: the parameters (shared ones averaged, units gathered) and the
        units' optimizer states, counted as the whole model with its states, (1 + states) / L (an
        upper bound: the shared parameters' states stay put)."""
        return IslandCost(label=f"ist L={self.sync_every}", exchanged=(1 + optimizer_states) / self.sync_every)

    @override
    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        problems = super().problems(run, shape)
        dims = run.dims
        for axis in ("dp_shard", "tp", "cp", "pp"):
            if getattr(dims, axis) > 1:
                problems.append(
                    f"strategy=ist slices whole MLPs on each island, but strategy.{axis}={getattr(dims, axis)}; "
                    f"use strategy.{axis}=1 (one rank per island)"
                )
        if shape is None:
            problems.append("strategy=ist needs a Llama-style model with SwiGLU MLPs; use another model or strategy")
        elif shape.num_experts:
            problems.append(
                "strategy=ist splits dense MLPs only, but the model is a mixture of experts; use a dense model "
                "or strategy=diloco"
            )
        elif dims.dp_replicate > 1 and shape.ffn_dim % dims.dp_replicate:
            problems.append(
                f"strategy=ist splits each MLP's {shape.ffn_dim} hidden units into strategy.dp_replicate="
                f"{dims.dp_replicate} equal groups; use a number of islands that divides {shape.ffn_dim}"
            )
        if run.compile:
            problems.append("strategy=ist changes the MLP shapes every round; set strategy.compile.enabled=false")
        if getattr(self.float8, "recipe", None) is not None:
            problems.append("strategy=ist slices plain Linear MLPs, not float8 ones; set strategy.float8.recipe=null")
        if run.adapters:
            problems.append("strategy=ist trains the base weights; set strategy.lora=null")
        if run.optimizer is not None and _is_muon(run.optimizer):
            problems.append("strategy=ist with optim=muon is not supported; use optim=adamw")
        return problems

    # ------------------------------------------------------------------------------ setup
    @override
    def setup(self, model: nn.Module, *, group: dist.ProcessGroup | None) -> None:
        """Finds the MLPs (every block's must be a plain SwiGLU) and the shared parameters.

        Raises:
            ValueError: a block whose MLP is not a SwiGLU of plain Linear layers (MoE, float8, LoRA).
        """
        super().setup(model, group=group)
        blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
        self.mlps = []
        for i, block in enumerate(blocks):
            mlp = block.feed_forward
            if not isinstance(mlp, SwiGLU) or any(type(m) is not nn.Linear for m in (mlp.w1, mlp.w2, mlp.w3)):
                raise ValueError(
                    f"strategy=ist: block {i}'s MLP ({type(mlp).__name__}) is not a SwiGLU of plain Linear layers; "
                    "use a dense model without float8 (strategy.float8.recipe=null) or another strategy"
                )
            self.mlps.append(mlp)
        split = {id(p) for mlp in self.mlps for p, _ in unit_params(mlp)}
        self.shared = [p for p in self.params.values() if id(p) not in split]

    # ------------------------------------------------------------------------------ the algorithm
    @override
    def step_context(self, step: int) -> AbstractContextManager[None]:
        """Applies the round's split before the first step of a round (the forward of ``step``)."""
        if self.groups is None:
            self.split_(self.optimizer)
        return super().step_context(step)

    @override
    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        self.optimizer = optimizer
        return super().after_step(model, step, optimizer)

    @override
    def run_length(self, total_steps: int) -> None:
        """Says when the run's last round is cut short: it trains on fewer steps than the others
        and is reassembled at the end (`end_training`), so nothing is lost, but its units saw less."""
        if total_steps % self.sync_every:
            rounds, last = -(-total_steps // self.sync_every), total_steps % self.sync_every
            self.say(
                f"strategy=ist: the run's {total_steps} planned steps make {rounds} rounds, the last of {last} steps "
                f"instead of strategy.local_sgd.sync_every={self.sync_every} (reassembled at the end); choose "
                f"trainer.max_steps as a multiple of {self.sync_every} for whole rounds"
            )

    @override
    def end_training(self, model: nn.Module) -> None:
        """A run that ends inside a round reassembles it (counted in ``comm/bytes_sent_total``), so
        the last evaluation, checkpoint and export see the whole model."""
        if self.groups is not None:
            self.bytes_sent += self.reassemble_(self.optimizer)
            self.round += 1

    def sync(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        if step % self.sync_every:
            return 0.0
        sent = self.reassemble_(optimizer)
        self.round += 1
        return sent

    @torch.no_grad()
    def split_(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Narrows every MLP to this island's units of the current round (parameters and their
        optimizer state); the parameter objects stay the same."""
        dims = [mlp.w1.weight.shape[0] for mlp in self.mlps]
        self.groups = split_units(dims, self.num_islands, seed=self.split_seed, round_index=self.round)
        for mlp, groups in zip(self.mlps, self.groups):
            idx = groups[self.island].to(mlp.w1.weight.device)
            for param, dim in unit_params(mlp):
                for key, value in unit_state(optimizer, param):
                    optimizer.state[param][key] = value.index_select(dim, idx)
                param.data = param.data.index_select(dim, idx)
                param.grad = None
            if self.scale_output:
                self._hooks.append(mlp.register_forward_hook(self._scale))

    def _scale(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        """A narrow MLP's output times the islands (``scale_output``)."""
        return output * self.num_islands

    @torch.no_grad()
    def reassemble_(self, optimizer: torch.optim.Optimizer | None) -> float:
        """Gathers every island's units into the full MLPs (parameters and optimizer state) and
        averages the shared parameters; returns the bytes this rank sent."""
        if self.groups is None:  # nothing trained narrow since the last reassembly
            return 0.0
        sent = average_(self.shared, self.group)
        full, sent_gather = self._gather(optimizer)
        self._install(full, optimizer)
        self._drop_split()
        return sent + sent_gather

    def _drop_split(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.groups = [], None

    def _unit_tensors(self, optimizer: torch.optim.Optimizer | None) -> list[tuple[int, nn.Parameter, str | None, int]]:
        """(MLP index, parameter, state key or None for the parameter itself, unit dim) of every
        tensor indexed by hidden unit, in the same order on every island."""
        out = []
        for m, mlp in enumerate(self.mlps):
            for param, dim in unit_params(mlp):
                out.append((m, param, None, dim))
                out += [(m, param, key, dim) for key, _ in unit_state(optimizer, param)]
        return out

    def _gather(self, optimizer: torch.optim.Optimizer | None) -> tuple[list[torch.Tensor], float]:
        """The full tensor of each of `_unit_tensors` (one all-gather per dtype) and the bytes sent."""
        tensors = self._unit_tensors(optimizer)
        narrow = [p.data if key is None else optimizer.state[p][key] for _, p, key, _ in tensors]
        full: list[torch.Tensor | None] = [None] * len(tensors)
        sent = 0.0
        for flat, index in flat_messages(narrow, self.group):
            received = [torch.empty_like(flat) for _ in range(self.num_islands)]
            dist.all_gather(received, flat, group=self.group)
            sent += allgather_bytes_sent(flat.numel() * flat.element_size(), self.num_islands)
            sizes = [narrow[i].numel() for i in index]
            per_island = [torch.split(r.to(narrow[index[0]].device), sizes) for r in received]
            for k, i in enumerate(index):
                m, _, _, dim = tensors[i]
                full[i] = widen([chunks[k].view_as(narrow[i]) for chunks in per_island], self.groups[m], dim)
        return full, sent

    def _install(self, full: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
        """Puts the full tensors of `_unit_tensors` in place of the narrow ones."""
        for (_, param, key, _), tensor in zip(self._unit_tensors(optimizer), full):
            if key is None:
                param.data = tensor
                param.grad = None
            else:
                optimizer.state[param][key] = tensor

    @contextmanager
    def _full(self, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        """The full MLPs in place while inside (a checkpoint in the middle of a round); the narrow
        tensors themselves afterwards."""
        if self.groups is None:
            yield
            return
        narrow = [p.data if key is None else optimizer.state[p][key] for _, p, key, _ in self._unit_tensors(optimizer)]
        full, _ = self._gather(optimizer)
        self._install(full, optimizer)
        try:
            yield
        finally:
            self._install(narrow, optimizer)

    # ------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Path,
        *,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        meta: dict[str, Any],
        writer: AsyncWriter | None = None,
    ) -> None:
        """Saves the full-shape model and optimizer state (`LocalSGD.save_checkpoint`)."""
        with self._full(optimizers[0] if optimizers else None):
            super().save_checkpoint(path, model=model, optimizers=optimizers, meta=meta, writer=writer)

    @override
    def load_checkpoint(
        self, path: Path, *, model: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        """Loads a full-shape checkpoint (`LocalSGD.load_checkpoint`); the next step splits it again.

        In the middle of a round (a rollback of ``train.nonfinite=rollback``) the narrow tensors are
        first replaced by full-shape ones: the checkpoint then sets every value.
        """
        self.optimizer = optimizers[0] if optimizers else None
        if self.groups is not None:
            tensors = self._unit_tensors(self.optimizer)
            narrow = [p.data if key is None else self.optimizer.state[p][key] for _, p, key, _ in tensors]
            self._install([widened(t, dim, self.num_islands) for t, (*_, dim) in zip(narrow, tensors)], self.optimizer)
            self._drop_split()
        return super().load_checkpoint(path, model=model, optimizers=optimizers)

    @override
    def state_dict(self, saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Counters, the split seed and the round index."""
        return {**super().state_dict(), "split_seed": self.split_seed, "round": self.round}

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the counters and the round.

        Raises:
            ValueError: the checkpoint was written with another split seed or number of islands.
        """
        super().load_state_dict(state)
        if int(state["split_seed"]) != self.split_seed:
            raise ValueError(
                f"the checkpoint was written with strategy.local_sgd.split_seed={int(state['split_seed'])}, this run "
                f"has {self.split_seed}; resume with strategy.local_sgd.split_seed={int(state['split_seed'])}"
            )
        self.round = int(state["round"])


def _is_muon(optimizer: Any) -> bool:
    """Whether the optimizer partial builds a `strategies.muon.Muon`."""
    target = getattr(optimizer, "func", optimizer)
    return isinstance(target, type) and issubclass(target, Muon)
