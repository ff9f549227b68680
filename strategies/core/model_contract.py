"""The model's declared contract: what plugins, the planner, export and generation read off a model.

`DecoderModel` lists every member plait reads (plait's `trainer.models.llama.Llama` and
`trainer.models.moe_transformer.MoETransformer` implement all of it). A model of one's own needs
only what its run uses: DDP and FSDP2 need ``layers`` and ``forward``; each other feature needs the
members of `NEEDS` (tensor parallelism a ``tp_plan``, context parallelism ``set_attention_core``,
pipeline stages the four modules and ``forward(..., return_hidden=)``, expert parallelism the
`MixtureOfExperts` sizes, read through `optional`; its router hooks are `trainer.protocols.RoutedModel`,
checked by the Task). `trainer.config.validate` refuses a layout whose members the model does
not declare (`layout_problems`), naming each; nothing is skipped.

This module is the one place that asks a model whether it has a member (`declares`, `optional`):
code elsewhere reads the declared members directly. It lives beside `strategies.core.shape` because the
plugins read it, and ``strategies/`` never imports ``trainer/``.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

# The sizes `strategies.core.shape.ModelShape` reads (every plugin's shape checks and the planner).
SIZES = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings")
# The sizes of a mixture of experts (`MixtureOfExperts`); a dense model has none of them.
MOE_SIZES = ("num_experts", "top_k", "moe_ffn_dim", "num_shared_experts", "n_dense_layers")
# The modules pipeline stages split (`strategies.pipeline.stages.split_model`): a stage sets the ones it
# does not hold to None, and ``forward`` skips them.
STAGE_MODULES = ("layers", "tok_embeddings", "norm", "output")

# Optional members and their value for a model that does not declare them.
OPTIONAL: dict[str, Any] = {
    "flops_per_token": None,  # no MFU in the logs
    "META_INIT": False,  # built on a real device, never on meta
    "attention_core": None,  # no swappable attention (no context parallelism, no KV cache)
    "tie_embeddings": False,
    "output": None,  # a pipeline stage's replay of its logits has no head
    **dict.fromkeys(MOE_SIZES, 0),
    "moe_ffn_dim": None,
    "sliding_window": None,  # no block attends within a window (Gemma 3's local blocks do)
    "window_layers": (),
    "attention_sinks": False,  # no sink logits in the softmax (GPT-OSS's attention has them)
    "expert_activation": "silu",  # SwiGLU experts (GPT-OSS's: "clamped_swiglu", with biases)
    "latent_attention": None,  # grouped-query attention (DeepSeek-V3's latent attention: its ranks)
    "head_dim": None,  # dim / n_heads (Qwen3, GPT-OSS, Gemma 3: a width of their own)
}

# How to add each member (the end of a refusal's message).
HINTS: dict[str, str] = {
    **{name: f"an int attribute self.{name} (see trainer.models.llama.Llama)" for name in SIZES},
    "tie_embeddings": "a bool attribute self.tie_embeddings (True: output.weight is tok_embeddings.weight)",
    "layers": "self.layers = nn.ModuleDict keyed by the global block index ('0', '1', ...)",
    "tok_embeddings": "self.tok_embeddings (an nn.Embedding; forward skips it when a stage sets it to None)",
    "norm": "self.norm (the final norm; forward skips it when a stage sets it to None)",
    "output": "self.output (the LM head nn.Linear; forward returns hidden states when a stage sets it to None)",
    "return_hidden": "a keyword argument forward(..., return_hidden: bool = False) returning [B, T, D] hidden states",
    "tp_plan": "a tp_plan(*, sequence_parallel, loss_parallel) method (see trainer.models.llama.Llama.tp_plan), "
    "override strategies.tensor.TensorParallel.plan (strategy.tensor_parallel._target_=...), or use strategy.tp=1",
    "set_attention_core": "a set_attention_core(core) method and an attention_core attribute "
    "(see trainer.models.llama.Llama.set_attention_core)",
    "attention_core": "an attention_core attribute (the core set_attention_core swaps)",
    "init_weights": "an init_weights() method filling every parameter in place (see trainer.models.llama.Llama)",
    **{
        name: f"the attribute self.{name} of a mixture of experts (see trainer.models.moe_transformer)"
        for name in MOE_SIZES
    },
}


@runtime_checkable
class DecoderModel(Protocol):
    """A decoder-only language model as plait reads it (`trainer.models.llama.Llama` implements it).

    Sizes: ``vocab_size`` V, ``dim`` D, ``n_layers``, ``n_heads`` H, ``n_kv_heads`` K, ``ffn_dim`` F,
    ``tie_embeddings``, ``max_seq_len``; modules `STAGE_MODULES`.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tie_embeddings: bool
    max_seq_len: int
    layers: nn.ModuleDict  # keyed by the global block index: a pipeline stage keeps its own keys
    tok_embeddings: nn.Module | None
    norm: nn.Module | None
    output: nn.Module | None
    attention_core: Any
    META_INIT: bool  # init_weights fills a model built on the meta device with the one-process values

    def forward(
        self,
        input_ids_bt: torch.Tensor,
        *,
        position_ids_bt: torch.Tensor | None = None,
        document_ids_bt: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]``; hidden states ``[B, T, D]`` with ``return_hidden`` or without ``output``."""
        ...

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
        """Module-name pattern -> DTensor ``ParallelStyle`` (tensor parallelism)."""
        ...

    def set_attention_core(self, core: Any) -> None:
        """Swaps the attention computation of every block (context parallelism, the KV cache)."""
        ...

    def init_weights(self) -> None:
        """(Re)initialises every parameter in place (after meta-device construction)."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (forward and backward), for MFU."""
        ...


@runtime_checkable
class MixtureOfExperts(Protocol):
    """The sizes of a mixture of experts (`trainer.models.moe_transformer.MoETransformer`):
    ``num_experts`` routed experts of width ``moe_ffn_dim``, ``top_k`` per token, plus
    ``num_shared_experts`` always-on ones; blocks below ``n_dense_layers`` are dense."""

    num_experts: int
    top_k: int
    moe_ffn_dim: int
    num_shared_experts: int
    n_dense_layers: int


# Members that are keywords of the model's forward, not attributes.
FORWARD_KEYWORDS = ("return_hidden", "token_mask_bt")


def declares(model: Any, member: str) -> bool:
    """Whether ``model`` (an instance or a class) has ``member`` (`FORWARD_KEYWORDS`: a keyword of its forward)."""
    if member in FORWARD_KEYWORDS:
        forward = getattr(model, "forward", None)
        return callable(forward) and member in inspect.signature(forward).parameters
    return hasattr(model, member)


def model_inputs(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of ``model``'s forward that come from ``batch`` beside its input ids,
    those the batch has (a model of one's own that takes input ids alone runs on rows without them).

    ``position_ids_bt`` and ``document_ids_bt``: the rows' ``position_ids`` and ``document_ids``
    ``[B, T]``. ``token_mask_bt``, only for a model whose forward declares it (a routed mixture of
    experts, `trainer.models.moe.MoE`) and rows with ``source_ids``: bool ``[B, T]``, True on real
    tokens and False on padding (``source_ids < 0``, the packer's mark: `trainer.data.packing`), so
    that the routers neither count padding in their loads nor balance over it. The one place these
    arguments are read off a batch: the objectives and the pipeline stages (`strategies.pipeline.stages`)
    call it.
    """
    inputs = {arg: batch[key] for key, arg in (("position_ids", "position_ids_bt"), ("document_ids", "document_ids_bt"))
              if key in batch}  # fmt: skip
    if "source_ids" in batch and declares(model, "token_mask_bt"):
        inputs["token_mask_bt"] = batch["source_ids"] >= 0
    return inputs


def missing(model: Any, members: tuple[str, ...] | list[str]) -> list[str]:
    """The members of ``members`` that ``model`` does not declare, in order."""
    return [m for m in members if not declares(model, m)]


def optional(model: Any, member: str) -> Any:
    """``model``'s ``member``, or its default (`OPTIONAL`) when the model does not declare it.

    Raises:
        KeyError: ``member`` is not an optional member of the contract.
    """
    return getattr(model, member, OPTIONAL[member])


def flops_per_token(model: Any, seq_len: int) -> float:
    """``model.flops_per_token(seq_len)``, or 0.0 for a model that does not declare it (no MFU)."""
    flops = optional(model, "flops_per_token")
    return float(flops(seq_len)) if flops is not None else 0.0


def _name(model: Any) -> str:
    cls = model if inspect.isclass(model) else type(model)
    return cls.__qualname__


def member_problem(model: Any, members: list[str] | tuple[str, ...], why: str) -> str:
    """The refusal of the feature ``why`` names (``strategy.tp=2``) for a model without ``members``
    (sizes are named together: ``declares no n_heads, ffn_dim; add int attributes ...``)."""
    if all(m in SIZES for m in members) and len(members) > 1:
        hint = f"the attributes {', '.join(f'self.{m}' for m in members)} (ints; tie_embeddings a bool; see trainer.models.llama.Llama)"
    else:
        hint = "; and ".join(HINTS.get(m, m) for m in members)
    return f"{why}: {_name(model)} declares no {', '.join(members)}; add {hint}"


# What each layout axis above 1 reads off the model besides ``layers`` and ``forward``; every one
# reads the sizes (its checks and the planner's work on `strategies.core.shape.ModelShape`).
NEEDS: dict[str, tuple[str, ...]] = {
    "tp": ("tp_plan", *SIZES),  # tp_plan: unless the tensor-parallel plugin overrides plan
    "cp": ("set_attention_core", "attention_core", *SIZES),
    "pp": (*STAGE_MODULES, "return_hidden", *SIZES),
}
# Members a class declares (methods, class attributes): what can be checked before the model is built.
CLASS_MEMBERS = frozenset(
    {"tp_plan", "set_attention_core", "return_hidden", "init_weights", "flops_per_token", "META_INIT"}
)


def layout_problems(model: Any, degrees: dict[str, int], *, tp_plan: bool = True) -> list[str]:
    """The members the layout's axes above 1 read and ``model`` lacks (`NEEDS`): one problem per
    member, the missing sizes in one, each naming the axis and how to add it.

    Args:
        model: the model built on the meta device, or its class when it cannot be built yet (then
            only `CLASS_MEMBERS` are checked; the rest when the model is built).
        degrees: the resolved degrees by axis, e.g. ``{"tp": 2, "cp": 1, "pp": 1}``.
        tp_plan: whether tensor parallelism applies the model's ``tp_plan`` (false: the strategy's
            tensor-parallel plugin overrides ``plan``).
    """
    problems = []
    for axis, needs in NEEDS.items():
        degree = degrees.get(axis, 1)
        if degree <= 1:
            continue
        needs = tuple(
            m for m in needs if (tp_plan or m != "tp_plan") and (not inspect.isclass(model) or m in CLASS_MEMBERS)
        )
        lacking = missing(model, needs)
        why = f"strategy.{axis}={degree}"
        problems += [member_problem(model, [m], why) for m in lacking if m not in SIZES]
        sizes = [m for m in lacking if m in SIZES]
        if sizes:
            problems.append(member_problem(model, sizes, why))
    return problems
