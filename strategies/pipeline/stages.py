"""Pipeline stages: the torch schedule of a ``strategy.pipeline.schedule`` name, the model split into
the stages a rank holds (views that share its submodules), and the last stage's loss on the hidden
states the schedule hands it (`strategies.pipeline.plugin.PipelineParallel` runs them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from strategies.core.model_contract import model_inputs
from strategies.pipeline.layout import SINGLE_STAGE, microbatch_problems

_CLASSES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBV": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


def build_schedule(
    modules: Sequence[nn.Module],
    *,
    stages: Sequence[int],
    num_stages: int,
    schedule: str,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
) -> Any:
    """The torch schedule running ``modules`` (this rank's ``stages``) over ``group``.

    Gradients are not rescaled (``scale_grads=False``): ``loss_fn`` carries the normalisation.

    Raises:
        ValueError: ``num_microbatches`` too few for the schedule (see `microbatch_problems`).
    """
    problems = microbatch_problems(
        schedule, pp=group.size(), stages_per_rank=len(stages), num_microbatches=num_microbatches
    )
    if problems:
        raise ValueError("\n".join(problems))
    torch_stages = [PipelineStage(m, s, num_stages, device, group=group) for m, s in zip(modules, stages)]
    cls = getattr(torch_schedules, _CLASSES[schedule])
    return cls(
        torch_stages[0] if schedule in SINGLE_STAGE else torch_stages,
        n_microbatches=num_microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )


def split_model(model: nn.Module, *, stages: Sequence[int], layers: Sequence[range]) -> list[nn.Module]:
    """Keeps in ``model`` only the parts of ``stages`` (in place); returns one module per stage.

    ``model`` needs ``tok_embeddings``, ``layers`` (ModuleDict keyed by global index), ``norm``
    and ``output``, and its forward must skip the ones that are None (see trainer.models.llama).
    With one stage, the stage module is ``model`` itself; otherwise each is a view sharing the
    submodules of ``model``.
    """
    num_stages = len(layers)
    keep = {str(i) for s in stages for i in layers[s]}
    for name in [name for name in model.layers.keys() if name not in keep]:
        del model.layers[name]
    if 0 not in stages:
        model.tok_embeddings = None
    if num_stages - 1 not in stages:
        model.norm, model.output = None, None
    if len(stages) == 1:
        return [model]
    return [_stage_view(model, s, num_stages, layers[s]) for s in stages]


def _stage_view(model: nn.Module, stage: int, num_stages: int, layers: range) -> nn.Module:
    # A fresh module of the model's class (own hooks, so FSDP can root each stage separately)
    # that shares the plain attributes, buffers and submodules of ``model``.
    view = type(model).__new__(type(model))
    nn.Module.__init__(view)
    for key, value in vars(model).items():
        view.__dict__.setdefault(key, value)
    for name, buffer in model.named_buffers(recurse=False):
        view.register_buffer(name, buffer, persistent=name not in model._non_persistent_buffers_set)
    for name, module in model.named_children():
        setattr(view, name, module)
    view.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    if stage != 0:
        view.tok_embeddings = None
    if stage != num_stages - 1:
        view.norm, view.output = None, None
    return view


class _Replay(nn.Module):
    """Stands in for the model in the Task's loss on the last stage.

    The last stage returns its final-norm hidden states [b, s, D]; the loss's call of the model
    applies the stage's LM head (``output``) to them, or returns them with ``return_hidden=True``
    (a chunked loss applies ``output.weight`` itself, `trainer.objectives.chunked_loss`).
    """

    def __init__(self, hidden: torch.Tensor, head: nn.Module) -> None:
        super().__init__()
        self.hidden, self.output = hidden, head

    def forward(self, *args: Any, return_hidden: bool = False, **kwargs: Any) -> torch.Tensor:
        return self.hidden if return_hidden else self.output(self.hidden)


def pack_targets(batch: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    """The keys of ``batch`` the loss reads besides ``input_ids`` (labels first; source ids,
    positions, document ids, ...: every [b, s] key) and them stacked as one [b, s, K] int64 tensor:
    the pipeline schedule hands the last stage one target tensor per micro-batch."""
    keys = [
        "labels",
        *(k for k, v in batch.items() if k not in ("input_ids", "labels") and v.shape == batch["labels"].shape),
    ]
    return keys, torch.stack([batch[k].long() for k in keys], dim=-1)


def stage_loss(
    loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    hidden: torch.Tensor,
    head: nn.Module,
    keys: Sequence[str],
    targets: torch.Tensor,
) -> torch.Tensor:
    """The Task's ``loss_fn(model, batch)`` on the last stage's hidden states [b, s, D].

    ``targets`` [b, s, K] holds the micro-batch's ``keys`` (`pack_targets`); the objective sees them
    as its batch (``input_ids`` = labels, for counting), and calls the model once (`_Replay`).
    """
    batch = dict(zip(keys, targets.unbind(-1)))
    return loss_fn(_Replay(hidden, head), {"input_ids": batch["labels"], **batch})


def model_kwargs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keyword arguments every stage's forward takes from the batch (positions, document ids, a routed
    model's token mask: `strategies.core.model_contract.model_inputs`), those the batch has."""
    return model_inputs(model, batch)


def backward_initialized(schedule: Any) -> bool:
    """Whether a torch pipeline schedule has inferred its stages' backward metadata (torch 2.13:
    ``_stage_backward_initialized`` on single-stage, ``_stages_backward_initialized`` on
    multi-stage schedules; True where neither exists)."""
    return bool(
        getattr(schedule, "_stages_backward_initialized", getattr(schedule, "_stage_backward_initialized", True))
    )
