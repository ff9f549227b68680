"""`ResolvedRun`: every fact of one run that more than one room needs, derived once.

`trainer.config.validate` derives it from the composed config (the only derivation of degrees,
world size and micro-batches); the builders, `MeshStrategy`, every plugin's ``problems``, the
planner and the data modules receive it, and none reads these facts out of the config again.
It lives under ``strategies/`` so that the plugins and the planner can name it (imports go
``trainer`` -> ``strategies``). See pytorch/torchtitan's ``ParallelDims`` (one object the trainer
passes around).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strategies.core.parallel_dims import ParallelDims
from strategies.core.shape import ModelShape

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ResolvedRun:
    """The resolved facts of one run.

    Attributes:
        world_size: ranks of the run (trainer.devices x trainer.num_nodes).
        dims: the resolved degrees (no -1).
        global_batch_size: rows per optimizer step over all data-parallel ranks.
        micro_batch_size: rows per forward/backward on one rank: train.micro_batch_size, or when
            null all of the rank's rows (with pp > 1: one row per pipeline micro-batch).
        num_micro_batches: micro-batches of one optimizer step on one dp rank
            (global_batch_size / (dp x micro_batch_size)).
        pp_stages_per_rank: pipeline stages per rank (1 for GPipe/1F1B, 2 for interleaved and V
            schedules unless strategy.pipeline.stages_per_rank says otherwise).
        pp_microbatches: micro-batches per pipeline schedule step
            (strategy.pipeline.num_microbatches, or all of the step's).
        pp_split_points: the first layer of every pipeline stage but the first: strategy.pipeline.split_points,
            or with strategy.pipeline.split=auto the planner's cost-balanced points (`trainer.semantics.resolve`);
            None: stages of equal layer counts (and always with pp == 1).
        seq_len: tokens per row (data.seq_len; 0 for a data node without one).
        vocab_size: the planned vocabulary: model.vocab_size, else the tokenizer file's size, else
            the size of the BPE plait trains (data.vocab_size; the trained one may be smaller, so
            the builder checks the built model again). None when unknown.
        shape: the model's sizes and tensors, read from the model built on the meta device
            (None for a model without Llama-style sizes).
        precision: the Lightning precision (trainer.precision).
        optimizer: the optimizer partial (``optim``, instantiated), for checks that need to know
            what state it keeps; None without one.
        drop_last: whether the data drops a last, partial global batch (data.drop_last).
        row_kind: what a row of the data module's batches is: "tokens", "pairs" or "unpaired"
            (the data class's ``row_kind_of(data node)``, `trainer.protocols.RowKind`); None when
            unknown (no data node, or one whose class cannot be imported).
        init_from: the weights the model starts from (model.init_from: a Hugging Face directory
            or a plait run / checkpoint); None: a fresh initialisation.
        compile: whether the blocks are compiled (strategy.compile.enabled).
        sequence_parallel: whether tp > 1 shards the residual stream on the sequence dimension
            (strategy.tensor_parallel.sequence_parallel under tp > 1).
        cp_placement: where cp ranks place rows (strategy.context_parallel.placement: "split"
            or "hybrid"; used when cp > 1).
        adapters: whether the strategy trains LoRA adapters on a frozen base (strategy.lora): the
            base alone, adapters off, is the initial policy.
        islands: whether dp replicas train apart and synchronise now and then (local SGD).
        notes: the strategy's launch warnings (`StrategyPlugin.notes`: settings that do nothing at
            this layout), printed before training.
        for_launch: whether the run is to be launched; False when it is only planned (``plait
            plan``, which needs the model's shape, not its weights): checks of what only a launch
            needs (LoRA's base in ``init_from``) are left out.
    """

    world_size: int
    dims: ParallelDims
    global_batch_size: int
    micro_batch_size: int
    num_micro_batches: int
    pp_stages_per_rank: int = 1
    pp_microbatches: int = 1
    pp_split_points: tuple[int, ...] | None = None
    seq_len: int = 0
    vocab_size: int | None = None
    shape: ModelShape | None = None
    precision: str = "32-true"
    optimizer: Callable[..., torch.optim.Optimizer] | None = None
    drop_last: bool = True
    row_kind: str | None = None
    init_from: str | None = None
    compile: bool = False
    sequence_parallel: bool = False
    cp_placement: str = "split"
    adapters: bool = False
    islands: bool = False
    notes: tuple[str, ...] = ()
    for_launch: bool = True
