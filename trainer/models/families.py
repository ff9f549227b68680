"""The Hugging Face model families plait reads and writes: one `Family` entry each, both directions.

An entry names the ``config.json`` identity (``model_type``, ``architectures``), the plait class
its checkpoints build, the architecture flags that tell the families apart (the constructor
arguments an import sets, the test an export makes of a model) and whether plait picks it for a
model of its own. The tensor names map in `trainer.models.hf` (dense: attention, norms,
embeddings, both directions) and `trainer.models.hf_moe` (routers and experts). Importing reads
`Family.import_kwargs` (`trainer.models.hf.llama_kwargs`); exporting chooses the family with
`export_family_of` and writes `Family.export_fields` (`trainer.export.hf_config`).

Adding a family whose architecture plait's `Llama` / `MoETransformer` flags already express is one
entry here (plus, for new tensor names, their pattern in `hf` / `hf_moe`). No family sets its own
chat template: an export writes the template the run trained with (`trainer.export`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strategies.core.hf_names import LATENT_LAYER_NAMES, LAYER_NAMES, POST_NORM_LAYER_NAMES, SANDWICH_LAYER_NAMES
from trainer.models.hf_moe import moe_config_fields, moe_export_problems, moe_kwargs
from trainer.models.llama import Llama
from trainer.models.moe_transformer import MoETransformer


class FamilyError(ValueError):
    """A model no family of plait's can be written as; the message names the feature."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face family.

    Attributes:
        model_type: ``config.json``'s ``model_type``.
        architecture: its ``architectures[0]`` (the transformers class).
        model_class: the plait class its checkpoints build.
        qkv_bias: q/k/v projections with biases (Qwen2).
        qk_norm: RMSNorm of q and k (Qwen3: each head; OLMo 2: each projection).
        qk_norm_scope: what ``qk_norm`` normalises (`Llama`'s ``qk_norm_scope``).
        norm_placement: ``"pre"`` (Llama) or ``"post"`` (OLMo 2) norms (`Llama`'s ``norm_placement``).
        nope: its configs name layers without RoPE (``no_rope_layers``, SmolLM3).
        norm_unit_offset, scale_embeddings, activation: `Llama`'s flags of the same names (Gemma).
        activation_key: the ``config.json`` field naming the MLP's activation.
        local_layers: its configs interleave sliding-window layers (``layer_types``, ``sliding_window``)
            with their own RoPE base, and set ``query_pre_attn_scalar`` (Gemma 3).
        windowed: the config's ``sliding_window`` applies even without ``use_sliding_window`` (Mistral,
            Mixtral: transformers applies any window their configs set).
        tied: transformers' ``tie_word_embeddings`` for a config that omits it (its config class's
            default: True for Gemma 3 and SmolLM3, whose hub configs leave it out).
        windows: its configs interleave sliding-window layers (``layer_types``, ``sliding_window``)
            with full ones, one RoPE for both (GPT-OSS).
        sinks: attention sinks, a bias on the attention output projection too (GPT-OSS;
            ``attention_bias`` sets all four projections' biases).
        latent_attention: multi-head latent attention and shared experts, the names of
            `strategies.core.hf_names.LATENT_LAYER_NAMES` (DeepSeek-V3).
        chosen: an export picks it for a model that fits it (false: only when the source was one).
    """

    model_type: str
    architecture: str
    model_class: type[Llama]
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    norm_placement: str = "pre"
    nope: bool = False
    norm_unit_offset: bool = False
    scale_embeddings: bool = False
    activation: str = "silu"
    activation_key: str = "hidden_act"
    local_layers: bool = False
    windowed: bool = False
    tied: bool = False
    windows: bool = False
    sinks: bool = False
    latent_attention: bool = False
    chosen: bool = True

    @property
    def moe(self) -> bool:
        """Whether its checkpoints hold routed experts (`trainer.models.hf_moe`)."""
        return issubclass(self.model_class, MoETransformer)

    @property
    def layer_names(self) -> Mapping[str, str]:
        """plait block module -> its Hugging Face name (`strategies.core.hf_names`)."""
        if self.sinks:  # the sinks are a parameter of the attention module itself
            return {**LAYER_NAMES, "attention": "self_attn"}
        if self.latent_attention:
            return LATENT_LAYER_NAMES
        return {"pre": LAYER_NAMES, "post": POST_NORM_LAYER_NAMES, "sandwich": SANDWICH_LAYER_NAMES}[
            self.norm_placement
        ]

    def import_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """The constructor arguments of ``model_class`` this family sets beyond the shared sizes."""
        return {
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
            "qk_norm_scope": self.qk_norm_scope,
            "norm_placement": self.norm_placement,
            "norm_unit_offset": self.norm_unit_offset,
            "scale_embeddings": self.scale_embeddings,
            "activation": self.activation,
            **({"nope_layers": nope_layers_of(config)} if self.nope else {}),
            **(local_layers_of(config) if self.local_layers else {}),
            **(window_layers_of(config) if self.windows else {}),
            **({"attention_sinks": True, "o_bias": True} if self.sinks else {}),
            **(moe_kwargs(config, self.model_type) if self.moe else {}),
        }

    def fits(self, model: Llama) -> bool:
        """Whether ``model`` has exactly this family's architecture flags and kind (dense or MoE);
        a family with ``nope`` (``local_layers``) also fits a model without such layers."""
        gemma_local = model.query_pre_attn_scalar is not None or model.rope_local_theta is not None
        local = model.window_layers or gemma_local
        return (
            (self.nope or not model.nope_layers)
            and (self.local_layers or not local or self.windows and not gemma_local)
            and (self.sinks, self.sinks) == (model.attention_sinks, model.o_bias)
            and _flags(model)
            == (
                self.qkv_bias,
                self.qk_norm,
                self.qk_norm_scope if self.qk_norm else None,
                self.norm_placement,
                self.moe,
                self.norm_unit_offset,
                self.scale_embeddings,
                self.activation,
                self.latent_attention,
            )
        )

    def export_fields(self, model: Llama) -> dict[str, Any]:
        """The ``config.json`` fields this family adds for ``model`` beyond the shared sizes."""
        fields = moe_config_fields(model, self.model_type) if self.moe else {}
        fields[self.activation_key] = HF_ACTIVATIONS[model.activation]
        if self.nope:  # 1: the layer applies RoPE (transformers' SmolLM3Config)
            fields["no_rope_layers"] = [int(i not in model.nope_layers) for i in range(model.n_layers)]
        if self.local_layers:
            fields.update(
                sliding_window=model.sliding_window,
                layer_types=[
                    "sliding_attention" if i in model.window_layers else "full_attention" for i in range(model.n_layers)
                ],
                query_pre_attn_scalar=model.query_pre_attn_scalar or model.head_dim,
                use_bidirectional_attention=False,
            )
        if self.windows:
            fields.update(
                sliding_window=model.sliding_window,
                layer_types=[
                    "sliding_attention" if i in model.window_layers else "full_attention" for i in range(model.n_layers)
                ],
            )
        return fields if self.qkv_bias else {**fields, "attention_bias": False}


# plait's activation -> the name transformers' configs give it.
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def _flags(model: Llama) -> tuple:
    scope = model.qk_norm_scope if model.qk_norm else None
    moe = isinstance(model, MoETransformer)
    gemma = (model.norm_unit_offset, model.scale_embeddings, model.activation)
    latent = moe and model.latent_attention is not None
    return model.qkv_bias, model.qk_norm, scope, model.norm_placement, moe, *gemma, latent


def local_layers_of(config: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 ``config.json``'s windowed layers as `Llama` arguments: ``sliding_window``,
    ``window_layers`` (``layer_types``' sliding ones, else all but every ``sliding_window_pattern``-th:
    transformers' default 6), ``rope_local_theta`` (``rope_parameters.sliding_attention``'s base, else
    ``rope_local_base_freq``, else 10000) and ``query_pre_attn_scalar``."""
    n_layers = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if kinds is None:
        pattern = config.get("sliding_window_pattern", 6)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    return {
        "sliding_window": config.get("sliding_window"),
        "window_layers": [i for i in range(n_layers) if kinds[i] == "sliding_attention"],
        "rope_local_theta": float(local.get("rope_theta", config.get("rope_local_base_freq", 10000.0))),
        "query_pre_attn_scalar": config.get("query_pre_attn_scalar"),
    }


def window_layers_of(config: dict[str, Any]) -> dict[str, Any]:
    """A GPT-OSS ``config.json``'s windowed layers as `Llama` arguments: ``sliding_window`` and
    ``window_layers`` (``layer_types``' sliding ones, else every other layer from the first:
    transformers' ``GptOssConfig`` default)."""
    n_layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
    ]
    return {
        "sliding_window": config.get("sliding_window"),
        "window_layers": [i for i in range(n_layers) if kinds[i] == "sliding_attention"],
    }


def nope_layers_of(config: dict[str, Any]) -> list[int]:
    """The layers a SmolLM3 ``config.json`` runs without RoPE: the 0s of ``no_rope_layers``, else
    every ``no_rope_layer_interval``-th layer (transformers' default interval: 4)."""
    n_layers = config["num_hidden_layers"]
    uses_rope = config.get("no_rope_layers")
    if uses_rope is None:
        interval = config.get("no_rope_layer_interval", 4)
        uses_rope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    return [i for i in range(n_layers) if not uses_rope[i]]


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM", Llama),
        Family("mistral", "MistralForCausalLM", Llama, windowed=True, chosen=False),
        Family("qwen2", "Qwen2ForCausalLM", Llama, qkv_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", Llama, qk_norm=True),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", MoETransformer, qk_norm=True),
        Family("mixtral", "MixtralForCausalLM", MoETransformer, windowed=True),
        Family("olmo2", "Olmo2ForCausalLM", Llama, qk_norm=True, qk_norm_scope="projection", norm_placement="post"),
        Family("smollm3", "SmolLM3ForCausalLM", Llama, nope=True, tied=True),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            Llama,
            qk_norm=True,
            norm_placement="sandwich",
            norm_unit_offset=True,
            scale_embeddings=True,
            activation="gelu_tanh",
            activation_key="hidden_activation",
            local_layers=True,
            tied=True,
        ),
        # Sinks, q/k/v/o biases, alternating windows; experts with biases and the clamped SwiGLU,
        # a router with a bias whose top-k logits' softmax is plait's renormalised top-k softmax.
        Family("gpt_oss", "GptOssForCausalLM", MoETransformer, qkv_bias=True, windows=True, sinks=True),
        Family("deepseek_v3", "DeepseekV3ForCausalLM", MoETransformer, latent_attention=True),
    )
}
# The plait classes a Hugging Face directory can be written from (their subclasses too).
EXPORTABLE: tuple[type, ...] = tuple(dict.fromkeys(f.model_class for f in FAMILIES.values()))


def family_of(config: dict[str, Any]) -> str | None:
    """The family (``model_type``) of a Hugging Face ``config.json``; None when plait has none."""
    archs = config.get("architectures") or [
        FAMILIES[config["model_type"]].architecture if config.get("model_type") in FAMILIES else ""
    ]
    return next(
        (t for t, f in FAMILIES.items() if archs == [f.architecture] and config.get("model_type", t) == t), None
    )


def exportable(model_cls: type) -> bool:
    """Whether plait can write a model of ``model_cls`` as a Hugging Face directory (`EXPORTABLE`)."""
    return issubclass(model_cls, EXPORTABLE)


def export_family_of(model: Llama, base: dict[str, Any] | None = None) -> str:
    """The family ``model`` is written as: its source's (``base``, the ``config.json`` it was
    loaded from), else the one chosen family it fits.

    Raises:
        FamilyError: no family has the model's features, or its source's family does not fit it.
    """
    source = family_of(base) if base is not None else None
    fitting = [f.model_type for f in FAMILIES.values() if f.chosen and f.fits(model)]
    family = source if source is not None and FAMILIES[source].fits(model) else next(iter(fitting), None)
    if family is None:
        others = [f"norm_placement={model.norm_placement!r}"] if model.norm_placement != "pre" else []
        others += [f"qk_norm_scope={model.qk_norm_scope!r}"] if model.qk_norm and model.qk_norm_scope != "head" else []
        others += [f"nope_layers={list(model.nope_layers)}"] if model.nope_layers else []
        others += [f"window_layers={list(model.window_layers)}"] if model.window_layers else []
        others += [f"{name}=True" for name in ("attention_sinks", "o_bias") if getattr(model, name)]
        others += [f"activation={model.activation!r}"] if model.activation != "silu" else []
        gemma = {"norm_unit_offset": model.norm_unit_offset, "scale_embeddings": model.scale_embeddings}
        others += [f"{name}=True" for name, on in gemma.items() if on]
        raise FamilyError(
            f"qk_norm={model.qk_norm}, qkv_bias={model.qkv_bias}{''.join(', ' + o for o in others)} "
            f"({type(model).__name__}) fit no Hugging Face architecture "
            f"in plait's families ({', '.join(f.architecture for f in FAMILIES.values())})"
        )
    if FAMILIES[family].moe and (problems := moe_export_problems(model, family)):
        raise FamilyError(
            f"this mixture of experts does not fit {FAMILIES[family].architecture}, the Hugging Face MoE "
            f"architecture closest to it: {'; '.join(problems)}"
        )
    if source is not None and family != source:
        raise FamilyError(f"a {family} model cannot be written as its source's {source}")
    return family
