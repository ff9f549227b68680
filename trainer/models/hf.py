"""Hugging Face checkpoints in and out of `llama.Llama`: Llama 2/3, Mistral, Qwen2, Qwen3, OLMo 2
and SmolLM3; and of `moe_transformer.MoETransformer`: Qwen3-MoE, Mixtral, DeepSeek-V3 and GPT-OSS (their
expert names: `trainer.models.hf_moe`, GPT-OSS's fused ones `trainer.models.hf_gpt_oss`). The families and what sets each apart: `trainer.models.families`.

A Hugging Face model directory holds ``config.json``, the weights as ``*.safetensors`` (one file,
or shards named by ``model.safetensors.index.json``) and the tokenizer (``tokenizer.json``,
``tokenizer_config.json`` with its chat template). Reading needs only ``safetensors`` and json;
``transformers`` is the tests' independent reference, never imported here.

Weights load after the strategy has parallelized the model (`trainer.init_from.load_init_from`,
called by ``Task.configure_model``): each rank reads, for each of its parameters, only the slice its
(FSDP and/or TP) shard holds, straight from the memory-mapped safetensors files. So no rank ever
materialises a full copy of a sharded model, and pipeline stages read only their own layers.

The names map one to one (plait's RoPE uses Hugging Face's half-split layout, so q/k rows need no
permutation); `trainer.export` writes any plait Llama back as a Hugging Face directory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from strategies.core.hf_names import hf_module_name, plait_module_name
from trainer.models import hf_gpt_oss as gpt_oss
from trainer.models.families import FAMILIES, HF_ACTIVATIONS, family_of
from trainer.models.hf_moe import (
    expert_hf_names,
    holds_expert_bias,
    moe_config_problems,
    moe_plait_name,
    router_hf_name,
)
from trainer.models.llama import Llama
from trainer.models.rope import rope_scaling_problems, rope_type

INDEX_FILE = "model.safetensors.index.json"


class HFError(ValueError):
    """A Hugging Face directory plait cannot read or write; the message names the field or file."""


# ---------------------------------------------------------------------------------------------- config
def is_hf_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model directory (it has a ``config.json``)."""
    return (Path(path).expanduser() / "config.json").is_file()


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory.

    Raises:
        HFError: no readable ``config.json``.
    """
    path = Path(directory).expanduser() / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise HFError(f"{path}: cannot read a Hugging Face config ({err})") from None


def rope_of(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a config, in the older (``rope_theta`` + ``rope_scaling``)
    or the newer (``rope_parameters``) Hugging Face layout; the scaling is None when there is none.
    A config with both (a ``rope_scaling`` block pasted into a transformers 5 config, as Qwen's
    YaRN instructions say) is read as transformers 5 reads it: the block replaces the parameters
    (their ``rope_theta`` included: the config's top-level one or 10000 then), and for per-layer
    parameters (Gemma 3) it updates the global layers'."""
    params = dict(config.get("rope_parameters") or {})
    per_layer = "full_attention" in params  # per layer type (Gemma 3): the global layers' (the local ones: families)
    if per_layer:
        params = dict(params["full_attention"] or {})
    legacy = dict(config.get("rope_scaling") or {})
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")
    if legacy:
        params = {**params, **legacy} if per_layer else legacy
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta), (params if rope_type(params) != "default" else None)


def sliding_window(config: dict[str, Any]) -> int | None:
    """The attention window the checkpoint's own model would apply, or None (full attention)."""
    kinds = set(config.get("layer_types") or ["full_attention"])
    own = FAMILIES.get(config.get("model_type"))
    if own is not None and (own.local_layers or own.windows):
        return None  # its windows are the model's own (Llama's sliding_window), not a cap on the context
    windowed = config.get("model_type") in FAMILIES and FAMILIES[config["model_type"]].windowed
    if windowed or config.get("use_sliding_window") or kinds != {"full_attention"}:
        return config.get("sliding_window")
    return None


def config_problems(config: dict[str, Any], where: str = "config.json") -> list[str]:
    """What plait's Llama cannot reproduce in a Hugging Face config; each message names the field."""
    family = family_of(config)
    if family is None:
        return [
            f"{where}: architectures={config.get('architectures')} (model_type={config.get('model_type')!r}) is not "
            f"supported; supported: {', '.join(f.architecture for f in FAMILIES.values())}"
        ]
    problems = []
    key = FAMILIES[family].activation_key
    if config.get(key, "silu") != HF_ACTIVATIONS[FAMILIES[family].activation]:
        problems.append(
            f"{where}: {key}={config[key]!r} is not supported ({FAMILIES[family].architecture}: "
            f"{HF_ACTIVATIONS[FAMILIES[family].activation]} only)"
        )
    unsupported = {
        "mlp_bias": (False, "no MLP biases"),
        "attention_bias": (
            FAMILIES[family].sinks,
            "q/k/v biases only in Qwen2 checkpoints, no o_proj bias; GPT-OSS's q/k/v/o biases",
        ),
        "partial_rotary_factor": (1.0, "RoPE on the whole head"),
        "attention_dropout": (0.0, "no attention dropout"),
        "quantization_config": (
            None,
            "unquantized weights: load a quantized checkpoint, such as GPT-OSS's "
            "MXFP4 experts, in transformers dequantized (Mxfp4Config(dequantize=True)) and "
            "save_pretrained its bf16 copy; DeepSeek-V3's FP8 blocks likewise with "
            "FineGrainedFP8Config(dequantize=True)",
        ),
        "attn_logit_softcapping": (None, "no soft-capping of attention logits"),
        "final_logit_softcapping": (None, "no soft-capping of the output logits"),
        "use_bidirectional_attention": (False, "causal attention only"),
    }
    for field, (ok, why) in unsupported.items():
        if config.get(field, ok) != ok:
            problems.append(f"{where}: {field}={config[field]!r} is not supported ({why})")
    _, scaling = rope_of(config)
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    problems += [f"{where}: {p}" for p in rope_scaling_problems(scaling, where=key)]
    local = ((config.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_type", "default")
    if local != "default":  # the windowed blocks' own tables take a base only (model.rope_local_theta)
        problems.append(
            f"{where}: rope_parameters.sliding_attention.rope_type={local!r} is not supported (the sliding-window "
            "layers' RoPE takes a base only: rope_type 'default')"
        )
    if FAMILIES[family].moe:
        problems += moe_config_problems(config, family, where)
    for key in ("layer_types", "no_rope_layers"):  # one entry per layer (an edited config may lose some)
        values = config.get(key)
        if isinstance(values, list) and len(values) != config.get("num_hidden_layers"):
            problems.append(
                f"{where}: {key} has {len(values)} entries for num_hidden_layers={config.get('num_hidden_layers')}; "
                "give one per layer"
            )
    return problems


def llama_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """`Llama` constructor arguments of a (supported) Hugging Face config.

    Raises:
        HFError: the config has a field plait cannot reproduce (see `config_problems`).
    """
    problems = config_problems(config)
    if problems:
        raise HFError("; ".join(problems))
    family, (theta, scaling) = family_of(config), rope_of(config)
    max_seq_len = config.get("max_position_embeddings", 2048)
    window = sliding_window(config)
    return {
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "ffn_dim": config["intermediate_size"],
        # A window at least as long as every sequence is no window: cap the context there.
        "max_seq_len": min(max_seq_len, window) if window else max_seq_len,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(config.get("tie_word_embeddings", FAMILIES[family].tied)),
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        **FAMILIES[family].import_kwargs(config),
    }


def llama_from_hf(
    init_from: str,
    *,
    config_from: str | None = None,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    init_std: float = 0.02,
    tie_embeddings: bool | None = None,
    **router: float,
) -> Llama:
    """A `Llama` (or, for Qwen3-MoE, Mixtral and DeepSeek-V3, a `MoETransformer`) with the architecture of a
    Hugging Face directory; its weights load later (after the strategy has
    parallelized the model, `trainer.init_from.load_init_from`). The ``model=hf`` preset.

    Args:
        init_from: the Hugging Face model directory (or, with ``config_from``, the plait run of
            one whose weights the run starts from: `trainer.init_from.take_run_model` sets both).
        config_from: the Hugging Face directory whose ``config.json`` sets the architecture; None:
            ``init_from``.
        vocab_size: the tokenizer's size (passed by the trainer); must not exceed the checkpoint's.
        max_seq_len: RoPE table length; None: the checkpoint's ``max_position_embeddings`` (capped
            at its sliding window). Must not exceed them.
        init_std: init of weights the checkpoint does not hold (none for a complete checkpoint).
        tie_embeddings: None: the checkpoint's ``tie_word_embeddings``; false unties a tied one
            (the output head starts as a copy of the input embedding and trains on its own: what
            ``strategy.pp > 1`` needs, as the two live on the first and the last stage).
        **router: a mixture of experts' training knobs (``balance_coef``, ``z_loss_coef``,
            ``bias_update_rate`` of `MoETransformer`; all 0 unless given).

    Raises:
        HFError: an unsupported config, sizes beyond the checkpoint's, router knobs for a dense
            one, or ``tie_embeddings=true`` for an untied one.
    """
    init_from = config_from or init_from  # the architecture's directory, named in the messages
    config = read_config(init_from)
    kwargs = llama_kwargs(config)
    if router and not FAMILIES[family_of(config)].moe:
        raise HFError(f"{', '.join(f'model.{k}' for k in router)}: {init_from} is a dense model, without a router")
    if vocab_size is not None and vocab_size > kwargs["vocab_size"]:
        raise HFError(
            f"the tokenizer has {vocab_size} tokens but {init_from}/config.json has vocab_size={kwargs['vocab_size']}; "
            "use the checkpoint's own tokenizer (data.tokenizer=null takes it from model.init_from)"
        )
    if tie_embeddings is not None:
        if tie_embeddings and not kwargs["tie_embeddings"]:
            raise HFError(
                f"model.tie_embeddings=true: {init_from} has a separate output head; use model.tie_embeddings=null"
            )
        kwargs["tie_embeddings"] = tie_embeddings
    if max_seq_len is not None:
        if max_seq_len > kwargs["max_seq_len"]:
            raise HFError(f"model.max_seq_len={max_seq_len} exceeds the checkpoint's {kwargs['max_seq_len']}")
        kwargs["max_seq_len"] = max_seq_len
    return FAMILIES[family_of(config)].model_class(**kwargs, **router, init_std=init_std)


# ---------------------------------------------------------------------------------------------- names
def hf_name(fqn: str, family: str | None = None) -> str:
    """Hugging Face tensor name of a plait parameter FQN (``layers.0.attention.wq.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``; a router's in the MoE ``family``).

    Raises:
        HFError: a name outside the family's modules (stacked experts: `hf_moe.expert_hf_names`).
    """
    router = router_hf_name(fqn, family) if family is not None and FAMILIES[family].moe else None
    if router is not None:
        return router
    module, _, leaf = fqn.rpartition(".")
    hf_module = hf_module_name(module, *_layer_names(family))
    if hf_module is not None:
        return f"{hf_module}.{leaf}"
    raise HFError(f"parameter {fqn} has no Hugging Face name")


def plait_name(name: str, family: str | None = None) -> str | None:
    """The plait FQN of a Hugging Face tensor name, or None (buffers such as ``rotary_emb.inv_freq``);
    an MoE ``family``'s router and expert tensors map to the router and stacked expert parameters."""
    moe = moe_plait_name(name, family) if family is not None and FAMILIES[family].moe else None
    if moe is not None:
        return moe
    module, _, leaf = name.rpartition(".")
    plait_module = plait_module_name(module, *_layer_names(family))
    return None if plait_module is None else f"{plait_module}.{leaf}"


def _layer_names(family: str | None) -> tuple:
    # The block's name table of the family (post-norm blocks name their norms otherwise); none: Llama's.
    return () if family is None else (FAMILIES[family].layer_names,)


# ---------------------------------------------------------------------------------------------- weights
def weight_files(directory: str | os.PathLike) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (from the index, else every file).

    Raises:
        HFError: no safetensors weights in ``directory``.
    """
    directory = Path(directory).expanduser()
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HFError(
            f"{directory} has no *.safetensors weights (pytorch_model.bin is not read; re-save with safetensors)"
        )
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({name: file for name in f.keys()})
    return out


def _local_slices(param: torch.Tensor) -> tuple[tuple[slice, ...], torch.Tensor]:
    """The global index range of this rank's shard of ``param`` and the local tensor to fill."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape), param.data
    # Private but stable (DCP plans its reads with it): this rank's chunk of the global tensor.
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise HFError(f"a shard of {tuple(param.shape)} with placements {param.placements} is not one contiguous block")
    return tuple(slice(o, o + n) for o, n in zip(offset, shape)), local


@torch.no_grad()
def load_hf_weights(
    model: nn.Module, directory: str | os.PathLike, *, skip: Callable[[str], bool] | None = None
) -> None:
    """Fills every parameter ``model`` holds on this rank from a Hugging Face directory, but those
    whose FQN ``skip`` selects (the caller's: LoRA adapters keep their initialisation,
    `trainer.init_from.load_init_from`).

    Each parameter (plain tensor or FSDP/TP/EP DTensor shard) reads only its own slice of the
    memory-mapped file and is cast to its dtype; a stacked expert tensor reads only the experts
    of its shard. The routers' selection biases (buffers, whole on every rank) load too in a family
    that holds them (DeepSeek-V3); its multi-token-prediction block (the layers from
    ``num_hidden_layers`` on) is skipped. No collective: every rank works alone.

    Raises:
        HFError: a tensor of the directory has no plait name, a parameter has no tensor, or shapes differ.
    """
    files = weight_files(directory)
    config = read_config(directory)
    family = family_of(config)
    if family is not None and holds_expert_bias(family):  # transformers skips the MTP block too
        mtp = re.compile(rf"model\.layers\.(\d+)\.")
        files = {
            n: f
            for n, f in files.items()
            if not ((m := mtp.match(n)) and int(m.group(1)) >= config["num_hidden_layers"])
        }
    unknown = [n for n in files if plait_name(n, family) is None and not n.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise HFError(f"{directory} holds tensors plait's model has no place for: {', '.join(unknown[:5])}")
    handles: dict[Path, Any] = {}

    def tensor(name: str, fqn: str, shape: list[int]) -> Any:
        if name not in files:
            raise HFError(f"{directory} has no tensor {name} for parameter {fqn}")
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(files[name]), framework="pt").__enter__()
        source = handles[files[name]].get_slice(name)
        if list(source.get_shape()) != shape:
            raise HFError(f"{name}: shape {source.get_shape()} in {directory}, plait's {fqn} needs {shape}")
        return source

    try:
        for fqn, param in model.named_parameters():
            if skip is not None and skip(fqn):  # e.g. LoRA adapters: the base is what loads
                continue
            index, local = _local_slices(param)
            fused = gpt_oss.expert_source(fqn, tuple(param.shape)) if family == "gpt_oss" else None
            if fused is not None:  # GPT-OSS: this shard's experts, taken out of the fused tensor
                name, hf_shape, take = fused
                local.copy_(take(tensor(name, fqn, hf_shape)[index[0]])[(slice(None), *index[1:])])
                continue
            experts = (
                expert_hf_names(fqn, family, range(index[0].start, index[0].stop))
                if family is not None and FAMILIES[family].moe
                else None
            )
            if experts is not None:  # [E, out, in]: one checkpoint tensor per expert of this shard
                for j, name in enumerate(experts):
                    local[j].copy_(tensor(name, fqn, list(param.shape[1:]))[index[1:]])
                continue
            name = hf_name(fqn, family)
            if name not in files and fqn == "output.weight":
                name = "model.embed_tokens.weight"  # an untied model from a tied checkpoint
            local.copy_(tensor(name, fqn, list(param.shape))[index])
        if family is not None and holds_expert_bias(family):
            for fqn, buffer in model.named_buffers():
                if fqn.endswith("router.expert_bias"):
                    buffer.copy_(tensor(hf_name(fqn, family), fqn, list(buffer.shape))[:])
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
