"""DiLoCo and Streaming DiLoCo: inner optimizer steps on each island, an outer step every H steps.

Sources: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08105); Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"
(arXiv 2501.18512), whose fragments are implemented here without the overlap (a fragment's
all-reduce is blocking) and without mixing old and new parameters (alpha = 0). Case C11 (the anchor
and the outer momentum are checkpointed) and C12 (pseudo-gradient = global - local) come from
pytorch/torchft#238, #277 and #233.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from typing_extensions import override

from strategies.local_sgd.base import IslandCost, LocalSGD

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


def default_outer_optimizer(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum 0.9, lr 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def fragment_offset(fragment: int, *, num_fragments: int, sync_every: int) -> int:
    """The step phase at which ``fragment`` synchronises: steps t with t % sync_every == offset.

    Offsets spread the fragments evenly over the H steps; the last fragment synchronises at
    multiples of H, like plain DiLoCo (which is the case num_fragments = 1).
    """
    return ((fragment + 1) * sync_every // num_fragments) % sync_every


def assign_fragments(model: nn.Module, names: Sequence[str], num_fragments: int) -> dict[str, int]:
    """Fragment of each parameter name: block i of ``model.layers`` goes to fragment i % num_fragments
    (strided, as in Streaming DiLoCo); parameters outside the blocks (embeddings, final norm, output
    head) go to the last fragment."""
    blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    of_param = {id(p): i % num_fragments for i, block in enumerate(blocks) for p in block.parameters()}
    params = dict(model.named_parameters())
    return {name: of_param.get(id(params[name]), num_fragments - 1) for name in names}


class DiLoCo(LocalSGD):
    """DiLoCo: every ``sync_every`` inner steps, an outer step on the averaged pseudo-gradient.

    The Task's optimizer is the inner optimizer (its state stays on each island). At a sync,
    for the parameters of the fragments due: pseudo-gradient = global params at the last sync -
    local params (positive when the island moved down, case C12), averaged over the islands
    (one all-reduce), applied to the global params by the outer optimizer; every island then
    continues from the new global params. With num_fragments > 1 this is Streaming DiLoCo:
    each fragment has the same period H at its own phase (`fragment_offset`), so a sync sends
    about 1/num_fragments of the model.

    Args:
        sync_every: H, inner steps between two outer steps of a fragment.
        outer_optimizer: partial (Hydra ``_partial_: true``) taking the list of global parameters;
            None: `default_outer_optimizer`. With lr 1 and no momentum, one outer step sets the
            global params to the islands' mean.
        num_fragments: 1 for DiLoCo; > 1 for Streaming DiLoCo (at most the number of blocks).

    Raises:
        ValueError: sync_every or num_fragments < 1.
    """

    def __init__(
        self,
        *,
        sync_every: int = 50,
        outer_optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        num_fragments: int = 1,
    ) -> None:
        super().__init__()
        if sync_every < 1:
            raise ValueError(f"strategy.local_sgd.sync_every={sync_every} must be >= 1")
        if num_fragments < 1:
            raise ValueError(f"strategy.local_sgd.num_fragments={num_fragments} must be >= 1")
        self.sync_every, self.num_fragments = sync_every, num_fragments
        self.outer_optimizer_fn = outer_optimizer or default_outer_optimizer
        self.anchors: dict[str, torch.Tensor] = {}  # global params at the last sync (same sharding as params)
        self.fragments: dict[str, int] = {}
        self.outer: torch.optim.Optimizer | None = None

    def run_length(self, total_steps: int) -> None:
        """Says when the run ends before its first outer step, or with the islands apart: between two
        outer steps (one fragment), or always (fragments: each meets at its own steps)."""
        offsets = [
            fragment_offset(f, num_fragments=self.num_fragments, sync_every=self.sync_every)
            for f in range(self.num_fragments)
        ]
        if len(set(offsets)) == 1:  # one fragment, or all meeting at the same steps (sync_every=1)
            self.say(self.period_line(total_steps, self.sync_every, "sync_every"))
            return
        first = min(offset or self.sync_every for offset in offsets)  # the first step a fragment meets at
        if total_steps < first:
            self.say(
                f"warning: the run's {total_steps} planned steps end before its first fragment's synchronisation "
                f"(step {first}; strategy.local_sgd.sync_every={self.sync_every}): the islands never synchronise; "
                "lower strategy.local_sgd.sync_every"
            )
            return
        # Each fragment meets at its own steps, so at any last step the others have trained apart since theirs.
        self.say(
            f"warning: strategy.local_sgd.num_fragments={self.num_fragments}: each fragment synchronises at its own "
            f"steps, so the run's {total_steps} planned steps end with the islands apart (the last evaluation and the "
            "checkpoint hold each island's own weights); for one model at the end use strategy.local_sgd.num_fragments=1 "
            f"and trainer.max_steps a multiple of strategy.local_sgd.sync_every={self.sync_every}"
        )

    @override
    def cost(self, *, optimizer_states: int, param_bytes: int) -> IslandCost:
        """Each fragment's pseudo-gradient once per H steps (the whole model per H), in the parameters'
        dtype; kept: the anchors and the outer optimizer's states (counted on one probe parameter)."""
        probe = nn.Parameter(torch.zeros(2))
        probe.grad = torch.ones(2)
        outer = self.outer_optimizer_fn([probe])
        outer.step()
        states = sum(isinstance(v, torch.Tensor) and v.shape == probe.shape for v in outer.state[probe].values())
        fragments = f" fragments={self.num_fragments}" if self.num_fragments > 1 else ""
        return IslandCost(
            label=f"diloco H={self.sync_every}{fragments}", exchanged=1 / self.sync_every, kept=1 + states
        )

    def kept_tensors(self) -> list[torch.Tensor]:
        """The tensors `cost`'s ``kept`` counts: the anchors and the outer optimizer's state."""
        outer = [v for s in self.outer.state.values() for v in s.values()] if self.outer is not None else []
        return [*self.anchors.values(), *(v for v in outer if isinstance(v, torch.Tensor))]

    def setup(self, model: nn.Module, *, group: dist.ProcessGroup | None) -> None:
        super().setup(model, group=group)
        self.anchors = {name: p.detach().clone() for name, p in self.params.items()}
        self.outer = self.outer_optimizer_fn(list(self.anchors.values()))
        self.fragments = assign_fragments(model, list(self.params), self.num_fragments)

    runs_across_replica_groups = True  # plain DiLoCo: one quorum and one average per outer step

    @override
    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        problems = super().problems(run, shape)
        if self.replica_groups is not None and self.num_fragments > 1:
            problems.append(
                f"strategy.local_sgd.num_fragments={self.num_fragments} across torchft replica groups: Streaming "
                "DiLoCo's staggered fragments are not built there yet; use strategy.local_sgd.num_fragments=1"
            )
        n_layers = shape.n_layers if shape is not None else 1
        if self.num_fragments > max(n_layers, 1):
            problems.append(
                f"strategy.local_sgd.num_fragments={self.num_fragments} exceeds the model's {n_layers} blocks; "
                f"use strategy.local_sgd.num_fragments<={n_layers}"
            )
        return problems

    def sync(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        sent = 0.0
        for fragment in range(self.num_fragments):
            offset = fragment_offset(fragment, num_fragments=self.num_fragments, sync_every=self.sync_every)
            if step % self.sync_every == offset:
                sent += self.outer_step([n for n, f in self.fragments.items() if f == fragment])
        return sent

    @torch.no_grad()
    def outer_step(self, names: Sequence[str]) -> float:
        """Outer step of the parameters ``names``; returns the bytes this rank sent.

        Override to change what is sent or how it is applied (the anchors and ``self.outer`` are
        the global parameters and their optimizer).
        """
        anchors = [self.anchors[n] for n in names]
        params = [self.params[n] for n in names]
        pseudo_grads = [a - p.detach() for a, p in zip(anchors, params)]  # global - local (C12)
        sent, complete = self.average(pseudo_grads)
        if not complete:  # a replica group was lost during the average: this round's progress is dropped
            for param, anchor in zip(params, anchors):
                param.copy_(anchor)
            return sent
        for anchor, pseudo_grad in zip(anchors, pseudo_grads):
            anchor.grad = pseudo_grad
        self.outer.step()  # parameters without .grad (other fragments) are skipped
        self.outer.zero_grad(set_to_none=True)
        for param, anchor in zip(params, anchors):
            param.copy_(anchor)
        return sent

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self, saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Counters, the anchors and the outer optimizer's state as {state name: {param name: value}}.

        The outer state is created by its first step; a fresh run that loads a checkpoint written
        after that allocates it from the checkpoint's metadata (``saved``), DTensor-sharded like
        the anchor when it has the parameter's shape.
        """
        state = super().state_dict()
        state["anchor"] = dict(self.anchors)
        outer: dict[str, dict[str, Any]] = {}
        if saved is None:
            for name, anchor in self.anchors.items():
                for key, value in self.outer.state.get(anchor, {}).items():
                    outer.setdefault(key, {})[name] = value
        else:
            for entry, meta in saved.items():
                if not entry.startswith("outer."):
                    continue
                key, name = entry[len("outer.") :].split(".", 1)  # state names have no dots, param names do
                outer.setdefault(key, {})[name] = _allocate(meta, like=self.anchors[name])
        state["outer"] = outer
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)  # the anchors were loaded in place
        index = {name: i for i, name in enumerate(self.anchors)}
        per_param: dict[int, dict[str, Any]] = {}
        for key, values in state["outer"].items():
            for name, value in values.items():
                per_param.setdefault(index[name], {})[key] = value
        self.outer.load_state_dict({"state": per_param, "param_groups": self.outer.state_dict()["param_groups"]})


def _allocate(meta: Any, *, like: torch.Tensor) -> Any:
    """An empty destination for one saved DCP entry: a tensor shaped (and sharded) like ``like`` when
    the saved tensor has its shape, another tensor of the saved shape, or None for a non-tensor."""
    if not isinstance(meta, TensorStorageMetadata):
        return None
    if tuple(meta.size) == tuple(like.shape):
        return torch.zeros_like(like, dtype=meta.properties.dtype)
    return torch.zeros(tuple(meta.size), dtype=meta.properties.dtype, device=like.device)
