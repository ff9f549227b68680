"""What the planner reasons about: the model's tensors, one candidate layout, and the workload.

`ModelShape` reads a Llama-style model (built on the meta device, so a 405B model costs nothing)
into the list of its parameter tensors with the dimension tensor parallelism shards, taken from
the model's own ``tp_plan``. `Layout` is one point of the search space and knows the Hydra
overrides that select it. `Workload` holds what does not change between layouts (sequence length,
global batch, dtypes, optimizer, kernels).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

# Adam keeps two moments per parameter plus a 4-byte fp32 `step` scalar per tensor; SGD with
# momentum one buffer; plain SGD nothing.
OPTIMIZER_STATES = {"adamw": (2, True), "adam": (2, True), "sgd_momentum": (1, False), "sgd": (0, False)}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name, full shape and the dim tp shards (None: replicated).

    ``grad_tp_replicated``: its gradient is a full (Replicate) DTensor on every tp rank although the
    parameter is sharded; torch 2.13 does this for a row-wise (vocabulary-sharded) embedding.
    """

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    layer: int | None  # block index; None for the embedding, final norm and output head
    grad_tp_replicated: bool = False


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-style decoder and its parameter tensors.

    Build with `from_model` (a model on the meta device is enough).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tie_embeddings: bool
    params: tuple[ParamSpec, ...]

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def matmul_params_per_layer(self) -> int:
        """Weights of one block's matmuls (attention projections and SwiGLU)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.dim * (2 * q + 2 * kv) + 3 * self.dim * self.ffn_dim

    @classmethod
    def from_model(cls, model: nn.Module) -> "ModelShape":
        """Reads sizes and parameters of ``model`` (a `trainer.models.llama.Llama`, any device).

        The tp dim of each parameter follows the model's ``tp_plan``: column-wise Linear and
        row-wise Embedding shard dim 0, row-wise Linear and column-wise Embedding dim 1.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = model.tp_plan() if hasattr(model, "tp_plan") else {}
        specs, seen = [], set()
        for module_name, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:  # tied weights count once
                    continue
                seen.add(id(p))
                style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(module_name, pat)), None)
                embedding = isinstance(module, nn.Embedding)
                tp_dim = None
                if isinstance(style, ColwiseParallel):
                    tp_dim = 1 if embedding else 0
                elif isinstance(style, RowwiseParallel):
                    tp_dim = 0 if embedding else 1
                parts = module_name.split(".")
                layer = int(parts[1]) if parts[0] == "layers" and len(parts) > 1 else None
                replicated_grad = embedding and isinstance(style, RowwiseParallel)
                specs.append(ParamSpec(f"{module_name}.{pname}", tuple(p.shape), tp_dim, layer, replicated_grad))
        return cls(
            vocab_size=model.vocab_size, dim=model.dim, n_layers=model.n_layers, n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim, tie_embeddings=model.tie_embeddings,
            params=tuple(specs),
        )  # fmt: skip

    @classmethod
    def from_config(cls, model_cfg: Any, vocab_size: int | None = None) -> "ModelShape":
        """Builds ``model_cfg`` (a Hydra ``_target_`` node) on the meta device and reads it."""
        import torch
        from hydra.utils import instantiate

        with torch.device("meta"):
            model = instantiate(model_cfg, **({"vocab_size": vocab_size} if vocab_size else {}))
        return cls.from_model(model)


@dataclass(frozen=True)
class Layout:
    """One parallel layout and its memory/time knobs (a point of the planner's search).

    Degrees as in `strategies.parallel_dims.ParallelDims`; ``stages_per_rank`` is the virtual
    stages of interleaved/V schedules; ``ac`` is "none", "full" or "every_k" (with ``ac_every_k``).
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

    def with_(self, **changes: Any) -> "Layout":
        return replace(self, **changes)

    def overrides(self, trainer_devices: int | None = None) -> list[str]:
        """The Hydra overrides that run this layout with ``strategy=nd``."""
        out = ["strategy=nd"] + [f"strategy.{k}={getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")]
        if self.pp > 1:
            out += [f"strategy.pp_schedule={self.pp_schedule}", f"strategy.pipeline.stages_per_rank={self.stages_per_rank}"]
        if self.cp > 1:
            out.append(f"strategy.cp_mode={self.cp_mode}")
        if self.tp > 1 and not self.sequence_parallel:
            out.append("strategy.tensor_parallel.sequence_parallel=false")
        if self.ac != "none":
            out.append(f"strategy.activation_checkpoint.mode={self.ac}")
            if self.ac == "every_k":
                out.append(f"strategy.activation_checkpoint.every_k={self.ac_every_k}")
        if self.activation_offload:
            out.append("strategy.context_parallel.activation_offload=true")
        out.append(f"train.micro_batch_size={self.micro_batch_size}")
        if trainer_devices is not None:
            out.append(f"trainer.devices={trainer_devices}")
        return out

    def label(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if getattr(self, k) > 1]
        text = " ".join(parts) or "single"
        if self.pp > 1:
            text += f" {self.pp_schedule}" + (f"/v{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
        if self.cp > 1:
            text += f" {self.cp_mode}"
        return text


@dataclass(frozen=True)
class Workload:
    """What every layout of one plan shares.

    Args:
        seq_len: tokens per row.
        global_batch_size: rows per optimizer step.
        param_dtype: dtype of the kept (sharded) parameters, gradients and optimizer states.
        compute_dtype: dtype of activations and gathered parameters ("bf16" under bf16 mixed precision).
        optimizer: key of `OPTIMIZER_STATES`.
        document_masks: packed rows with document ids (block-causal masks) instead of plain causal.
        compile: blocks compiled (fused elementwise kernels).
        float8: matmuls of the Linear layers in float8 (time model only; plait trains bf16/fp32).
        async_tp: tensor-parallel collectives overlapped with the matmuls.
    """

    seq_len: int
    global_batch_size: int
    param_dtype: str = "fp32"
    compute_dtype: str = "fp32"
    optimizer: str = "adamw"
    document_masks: bool = True
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    def microbatches(self, layout: Layout) -> int:
        """Micro-batches each dp rank runs per optimizer step."""
        return self.global_batch_size // (layout.dp * layout.micro_batch_size)


# ---------------------------------------------------------------------------------- from a run's config
def layout_from_config(cfg: Any) -> Layout:
    """The layout a composed run config trains with (degrees resolved for its world size)."""
    from strategies.parallel_dims import ParallelDims
    from strategies.pipeline_layout import stages_per_rank_of

    s = cfg.strategy
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    dims = ParallelDims(**{k: s[k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}).resolve(world)
    micro = cfg.train.micro_batch_size or cfg.train.global_batch_size // dims.dp
    tp_cfg, ac = s.get("tensor_parallel") or {}, s.get("activation_checkpoint") or {}
    pipeline, context = s.get("pipeline") or {}, s.get("context_parallel") or {}
    return Layout(
        dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp, pp=dims.pp,
        pp_schedule=s.get("pp_schedule", "1F1B"),
        stages_per_rank=stages_per_rank_of(s.get("pp_schedule", "1F1B"), pipeline.get("stages_per_rank")),
        cp_mode=s.get("cp_mode", "ring"), micro_batch_size=micro,
        ac=ac.get("mode", "none"), ac_every_k=ac.get("every_k", 1),
        activation_offload=bool(context.get("activation_offload", False)),
        sequence_parallel=bool(tp_cfg.get("sequence_parallel", True)),
        loss_parallel=bool(tp_cfg.get("loss_parallel", True)),
    )  # fmt: skip


def workload_from_config(cfg: Any) -> Workload:
    """Sequence length, batch, dtypes, optimizer and kernels of a composed run config."""
    precision = str(cfg.trainer.precision)
    fsdp = cfg.strategy.get("fsdp") or {}
    param_dtype = "bf16" if precision == "bf16-true" else "fp32"
    compute = "bf16" if precision.startswith("bf16") or fsdp.get("param_dtype") == "bf16" else param_dtype
    target = str(cfg.optim.get("_target_", "")).lower()
    if "adam" in target:
        optimizer = "adamw"
    else:
        optimizer = "sgd_momentum" if cfg.optim.get("momentum") else "sgd"
    compile_cfg = cfg.strategy.get("compile") or {}
    planner = cfg.get("planner") or {}
    return Workload(
        seq_len=int(cfg.data.seq_len), global_batch_size=int(cfg.train.global_batch_size),
        param_dtype=param_dtype, compute_dtype=compute, optimizer=optimizer,
        document_masks=True, compile=bool(compile_cfg.get("enabled", False)),
        float8=bool(planner.get("float8", False)), async_tp=bool(planner.get("async_tp", False)),
    )  # fmt: skip


def shape_from_config(cfg: Any) -> ModelShape:
    """The model of a composed run config, read on the meta device (vocabulary from model or data)."""
    vocab = cfg.model.get("vocab_size") or (cfg.data.get("vocab_size") if cfg.get("data") is not None else None)
    return ModelShape.from_config(cfg.model, vocab_size=None if cfg.model.get("vocab_size") else vocab)
