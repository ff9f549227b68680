"""What the planner reasons about: one candidate layout and the workload, from a resolved run.

The model is a `strategies.core.shape.ModelShape` (the run's, built on the meta device). `Layout` is
one point of the search space and knows the Hydra overrides that select it. `Workload` holds what
does not change between layouts (sequence length, global batch, dtypes, optimizer, kernels).
`layout_of` and `workload_of` read them from a `ResolvedRun` and its strategy; nothing here reads
the run config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from strategies.core.resolved import ResolvedRun
from strategies.core.shape import ModelShape, ParamSpec
from strategies.local_sgd.base import LocalSGD
from strategies.local_sgd.ist import IST
from strategies.muon import ADAMW_PARAMS, Muon, adamw_params_of
from strategies.transforms.lora import degree_problems
from strategies.transforms.lora_targets import target_names

# Adam keeps two moments per parameter plus a 4-byte fp32 `step` scalar per tensor; SGD with
# momentum one buffer; plain SGD nothing. Muon: AdamW's for the parameters it leaves to AdamW, one
# momentum buffer per hidden matrix (`strategies.muon.takes_muon` with `Workload.adamw_params`;
# `MUON_MATRIX_STATES`).
OPTIMIZER_STATES = {
    "adamw": (2, True), "adam": (2, True), "sgd_momentum": (1, False), "sgd": (0, False), "muon": (2, True)
}  # fmt: skip
MUON_MATRIX_STATES = (1, False)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")  # the mesh's axes, as the strategy names them
# Settings of a layout the search does not vary: each searched layout keeps the command line's.
KEPT = ("sequence_parallel", "loss_parallel", "reshard_after_forward", "fsdp_cpu_offload")


@dataclass(frozen=True)
class Layout:
    """One parallel layout and its memory/time knobs (a point of the planner's search).

    Degrees as in `strategies.core.parallel_dims.ParallelDims`; ``stages_per_rank`` is the virtual
    stages of interleaved/V schedules; ``ac`` is "none", "full" or "every_k" (with ``ac_every_k``);
    ``ep`` is the expert-parallel degree of a mixture of experts (borrowed from dp_shard x cp).
    ``split_points`` the first layer of every pipeline stage but the first (None: by layer count).
    ``ist_islands``: Independent Subnet Training (strategy=ist) keeps 1 / ist_islands of every
    dense MLP's hidden units on each rank (1: off).
    ``local_sgd``: the local-SGD algorithm whose islands the dp_replicate ranks are (its
    `strategies.local_sgd.base.IslandCost` label; "": none, plain data parallel), with
    ``replica_exchange`` (parameter-sized all-reduces across dp_replicate per step: 1.0 is a
    gradient all-reduce every step), ``replica_kept`` (parameter-sized tensors it keeps per rank) and
    ``replica_overlapped`` (its exchanges run under compute).
    ``sequence_parallel``, ``loss_parallel`` (tensor parallelism's) and ``reshard_after_forward``
    (FSDP's: False keeps every block gathered from its forward to its backward, ZeRO-2) are the
    command line's: the search keeps them (`KEPT`) and prints them when they are off, and so is
    ``fsdp_cpu_offload`` (``strategy.fsdp.cpu_offload``: FSDP's shards of the parameters, gradients
    and optimizer state in host memory, not on the device).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    stages_per_rank: int = 1
    cp_mode: str = "ring"
    micro_batch_size: int = 1
    ac: str = "none"
    ac_every_k: int = 1
    activation_offload: bool = False
    sequence_parallel: bool = True
    loss_parallel: bool = True
    reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    ep: int = 1
    split_points: tuple[int, ...] | None = None
    ist_islands: int = 1
    local_sgd: str = ""
    replica_exchange: float = 1.0
    replica_kept: float = 0.0
    replica_overlapped: bool = False

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shards(self) -> int:
        """Ranks FSDP shards each parameter over: dp_shard x cp (cp ranks hold the same parameters)."""
        return self.dp_shard * self.cp

    @property
    def uses_fsdp(self) -> bool:
        return self.dp * self.cp > 1

    @property
    def fsdp_wraps(self) -> bool:
        """Whether FSDP wraps the model on a rank: it shards (dp_shard x cp > 1) or replicates across
        dp_replicate; local SGD's islands shard within an island only (`FSDP.active` with islands)."""
        return self.fsdp_shards > 1 or (self.dp_replicate > 1 and not self.local_sgd)

    def with_(self, **changes: Any) -> "Layout":
        return replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """Every config value this layout decides, by dotted key (a key that does not apply to it,
        such as the pipeline's without pp, is left out)."""
        out: dict[str, Any] = {f"strategy.{k}": getattr(self, k) for k in DEGREES}
        if self.pp > 1:
            out["strategy.pipeline.schedule"] = self.pp_schedule
            out["strategy.pipeline.stages_per_rank"] = self.stages_per_rank
            # None (by layer count) is written too: it undoes a command line's own split points
            out["strategy.pipeline.split_points"] = None if self.split_points is None else list(self.split_points)
        if self.cp > 1:
            out["strategy.context_parallel.mode"] = self.cp_mode
        if self.tp > 1:
            out["strategy.tensor_parallel.sequence_parallel"] = self.sequence_parallel
            out["strategy.tensor_parallel.loss_parallel"] = self.loss_parallel
        if self.uses_fsdp:
            out["strategy.fsdp.reshard_after_forward"] = self.reshard_after_forward
        # written for every layout: one without FSDP undoes a command line's offload, which it refuses
        out["strategy.fsdp.cpu_offload"] = self.fsdp_cpu_offload and self.uses_fsdp
        out["strategy.activation_checkpoint.mode"] = self.ac
        if self.ac == "every_k":
            out["strategy.activation_checkpoint.every_k"] = self.ac_every_k
        out["strategy.activation_offload.enabled"] = self.activation_offload
        out["strategy.expert_parallel.ep"] = self.ep
        out["train.micro_batch_size"] = self.micro_batch_size
        return out

    def overrides(self, trainer_devices: int | None = None, against: "Layout | None" = None) -> list[str]:
        """The Hydra overrides that run this layout with ``strategy=nd``: the degrees and the
        micro-batch size, and each other setting whose value is not ``strategy=nd``'s default, or not
        ``against``'s (the command line's layout, whose own values these overrides are added to)."""
        # strategy=nd's default of each setting that has one (the tensor-parallel and FSDP ones apply
        # to a layout with tp and FSDP); the pipeline's, cp's mode and every_k have none: always written
        default = Layout(dp_shard=2, tp=2).settings()
        theirs = against.settings() if against is not None else {}
        always = {*(f"strategy.{k}" for k in DEGREES), "train.micro_batch_size"}
        out = ["strategy=nd"] + [
            f"{key}={_override_value(value)}"
            for key, value in self.settings().items()
            if key in always or key not in default or value != default[key] or value != theirs.get(key, value)
        ]
        if trainer_devices is not None:
            out.append(f"trainer.devices={trainer_devices}")
        return out

    def label(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in DEGREES if getattr(self, k) > 1]
        text = " ".join(parts) or "single"
        if self.pp > 1:
            text += f" {self.pp_schedule}" + (f"/v{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
        if self.cp > 1:
            text += f" {self.cp_mode}"
        text += f" ep{self.ep}" if self.ep > 1 else ""
        return text + (f" ({self.local_sgd})" if self.local_sgd else "")


def _override_value(value: Any) -> str:
    """``value`` as Hydra's override grammar writes it (true / false, [a,b], null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


@dataclass(frozen=True)
class LoRASpec:
    """What the planner needs of LoRA (``strategy.lora``, `strategies.transforms.lora.LoRA`).

    Args:
        rank: r of every adapter (A [r, in], B [out, r]).
        targets: FQNs of the adapted linear layers (``layers.0.attention.wq``).
        dropout: dropout probability on the adapters' input.
        quantize: "nf4": QLoRA, the adapted layers' base weights in 4-bit NF4; None: a float base.
    """

    rank: int
    targets: frozenset[str]
    dropout: float = 0.0
    quantize: str | None = None

    @classmethod
    def of(cls, lora: Any, shape: ModelShape) -> "LoRASpec":
        """The settings of a LoRA plugin, its ``target_modules`` resolved against ``shape``'s linear
        layers by LoRA's own matching (`strategies.transforms.lora_targets.target_names`)."""
        targets = frozenset(target_names(shape.linear_modules, lora.target_modules))
        return cls(rank=lora.rank, targets=targets, dropout=lora.dropout, quantize=lora.quantize)

    def degree_problems(self, *, pp: int, tp: int) -> list[str]:
        """Why LoRA does not run at these degrees (`strategies.transforms.lora.degree_problems`)."""
        return degree_problems(pp=pp, tp=tp, quantize=self.quantize, dropout=self.dropout)

    def adapts(self, p: ParamSpec) -> bool:
        """Whether ``p`` is the weight of an adapted layer."""
        return p.name.endswith(".weight") and p.name.removesuffix(".weight") in self.targets


@dataclass(frozen=True)
class Workload:
    """What every layout of one plan shares.

    Args:
        seq_len: tokens per row.
        global_batch_size: rows per optimizer step.
        param_dtype: dtype of the kept (sharded) parameters, gradients and optimizer states.
        compute_dtype: dtype of activations ("bf16" under bf16 mixed precision).
        gather_dtype: dtype FSDP gathers parameters in (``strategy.fsdp.param_dtype``); None: ``param_dtype``
            (no mixed-precision policy: FSDP gathers what it holds).
        autocast: the forward runs under autocast (``bf16-mixed``, ``16-mixed``): a matmul's weight
            not already in ``compute_dtype`` is cast, and the copy is saved for the backward.
        optimizer: key of `OPTIMIZER_STATES`.
        document_masks: packed rows with document ids (block-causal masks) instead of plain causal.
        compile: blocks compiled (fused elementwise kernels).
        float8: matmuls of the Linear layers in float8 (strategy.float8.recipe set, or planner.float8's what-if).
        async_tp: tensor-parallel collectives overlapped with the matmuls.
        rows_per_item: model rows per batch row: 2 for a preference pair (chosen and rejected) and a
            KTO example with its KL stand-in (``ResolvedRun.row_kind`` "pairs" / "unpaired"), else 1.
        adamw_params: under ``optimizer="muon"``, the name substrings of the 2-D parameters left to
            AdamW (``optim.adamw_params``; `strategies.muon.takes_muon`).
        lora: LoRA's adapters on a frozen base (`LoRASpec`), None without LoRA.
    """

    seq_len: int
    global_batch_size: int
    param_dtype: str = "fp32"
    compute_dtype: str = "fp32"
    gather_dtype: str | None = None
    autocast: bool = False
    optimizer: str = "adamw"
    document_masks: bool = True
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    rows_per_item: int = 1
    adamw_params: tuple[str, ...] = ADAMW_PARAMS
    lora: LoRASpec | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def micro_batch_tokens(self, layout: Layout) -> int:
        """Tokens one micro-batch runs through the model on a rank (after context parallelism)."""
        return layout.micro_batch_size * self.rows_per_item * self.seq_len // layout.cp

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def gather_bytes(self) -> int:
        return DTYPE_BYTES[self.gather_dtype or self.param_dtype]

    def casts_weights(self, layout: Layout) -> bool:
        """Whether autocast copies the matmuls' weights on a rank of ``layout``: under autocast,
        unless FSDP hands them over gathered in the compute dtype already (it gathers nothing
        without data parallelism)."""
        gathered_in_compute = layout.fsdp_wraps and (self.gather_dtype or self.param_dtype) == self.compute_dtype
        return self.autocast and self.param_dtype != self.compute_dtype and not gathered_in_compute

    def microbatches(self, layout: Layout) -> int:
        """Micro-batches each dp rank runs per optimizer step."""
        return self.global_batch_size // (layout.dp * layout.micro_batch_size)


# ---------------------------------------------------------------------------------- from a resolved run
def optimizer_kind(optimizer: Callable[..., torch.optim.Optimizer] | None) -> str:
    """The key of `OPTIMIZER_STATES` for the state an optimizer partial keeps, found by stepping it
    on one scalar parameter: two moments (Adam family), a momentum buffer, or nothing; "muon" for a
    `strategies.muon.Muon` (its state depends on each parameter)."""
    if optimizer is None:
        return "sgd"
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    probe = optimizer([param])
    if isinstance(probe, Muon):
        return "muon"
    probe.step()
    state = probe.state[param]
    if "exp_avg" in state and "exp_avg_sq" in state:
        return "adamw"
    return "sgd_momentum" if state.get("momentum_buffer") is not None else "sgd"


def layout_of(run: ResolvedRun, strategy: Any, work: Workload) -> Layout:
    """The layout a resolved run trains with, and the knobs of its strategy's plugins (a `MeshStrategy`);
    ``work`` (`workload_of`) sizes what a local-SGD plugin exchanges and keeps."""
    dims, plugin = run.dims, strategy.plugins
    local_sgd = plugin.get("local_sgd")
    island = None
    if isinstance(local_sgd, LocalSGD):  # islands on dp_replicate, or torchft replica groups (dp_replicate 1)
        island = local_sgd.cost(optimizer_states=OPTIMIZER_STATES[work.optimizer][0], param_bytes=work.param_bytes)
    ac, tp, pipeline = plugin["activation_checkpoint"], plugin["tensor_parallel"], plugin["pipeline"]
    return Layout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        cp=dims.cp,
        tp=dims.tp,
        pp=dims.pp,
        pp_schedule=pipeline.schedule,
        stages_per_rank=run.pp_stages_per_rank,
        cp_mode=plugin["context_parallel"].mode,
        micro_batch_size=run.micro_batch_size,
        ac=ac.mode,
        ac_every_k=ac.every_k,
        activation_offload=plugin["activation_offload"].enabled,
        sequence_parallel=tp.sequence_parallel,
        loss_parallel=tp.loss_parallel,
        reshard_after_forward=plugin["fsdp"].reshard_after_forward,
        fsdp_cpu_offload=plugin["fsdp"].cpu_offload,
        ep=plugin["expert_parallel"].ep,
        split_points=run.pp_split_points,
        ist_islands=dims.dp_replicate if isinstance(local_sgd, IST) else 1,
        local_sgd=island.label if island is not None else "",
        replica_exchange=island.exchanged if island is not None else 1.0,
        replica_kept=island.kept if island is not None else 0.0,
        replica_overlapped=island.overlapped if island is not None else False,
    )


def workload_of(run: ResolvedRun, strategy: Any, *, float8: bool = False, async_tp: bool = False) -> Workload:
    """Sequence length, batch, dtypes, optimizer (and Muon's split), LoRA's adapters and kernels of a
    resolved run and its strategy (``float8``: planner.float8, a what-if; the strategy's float8
    plugin, when on, sets it too)."""
    param_dtype = {"bf16-true": "bf16", "16-true": "fp16"}.get(run.precision, "fp32")
    autocast = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(run.precision)
    gathered = strategy.plugins["fsdp"].param_dtype or None
    return Workload(
        seq_len=run.seq_len,
        global_batch_size=run.global_batch_size,
        param_dtype=param_dtype,
        compute_dtype=autocast or gathered or param_dtype,
        gather_dtype=gathered,
        autocast=autocast is not None,
        optimizer=optimizer_kind(run.optimizer),
        document_masks=True,
        compile=strategy.plugins["compile"].enabled,
        float8=float8 or strategy.plugins["float8"].recipe is not None,
        async_tp=async_tp,
        rows_per_item=2 if run.row_kind in ("pairs", "unpaired") else 1,
        adamw_params=adamw_params_of(run.optimizer),
        lora=None if (lora := strategy.plugins.get("lora")) is None else LoRASpec.of(lora, run.shape),
    )
