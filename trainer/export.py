"""``plait export ckpt=... out=...``: write a plait checkpoint as a Hugging Face model directory.

The directory has ``config.json`` (`hf_config`), the weights as safetensors
(sharded with an index above ``max_shard_mb``), ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja``: the chat template the run trained with (`trained_chat_template`), where
transformers 5 writes and reads it, so ``transformers.AutoModelForCausalLM.from_pretrained(out)``
loads the model and its tokenizer's ``apply_chat_template`` renders what SFT trained on. Any
checkpoint loads, whatever world size and layout wrote it (DCP reshards into one process).

Invocation::

    plait export ckpt=runs/sft out=exports/sft            # newest checkpoint of a run
    plait export ckpt=runs/sft/checkpoints/step_0000100 out=exports/sft dtype=bfloat16
    plait export ckpt=runs/lora_sft out=exports/lora_sft adapter=false   # a LoRA run: the merged model alone
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from strategies.checkpoint.dcp import CheckpointError
from strategies.transforms.lora import adapted_layers, merge_lora
from strategies.transforms.lora_targets import is_adapter
from trainer.capabilities import export_problem
from trainer.compose import compose_command, fail
from trainer.data.answer_end import turn_end_ids
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE, DEFAULT_DESCRIPTION, ChatError, JinjaTemplate, load_chat_template
from trainer.data.chat_files import TemplateFileError, find_chat_template, write_chat_template
from trainer.data.tokenizer import Tokenizer
from trainer.hf_sources import base_config, source_dirs
from trainer.init_from import load_init_from
from trainer.models import families
from trainer.models import hf_gpt_oss as gpt_oss
from trainer.models.families import FAMILIES, FamilyError, exportable
from trainer.models.hf import INDEX_FILE, HFError, hf_name, is_hf_dir
from trainer.models.hf_moe import EXPERT_BIAS_SUFFIX, FLOAT32_SUFFIXES, holds_expert_bias, split_experts
from trainer.models.llama import Llama
from trainer.peft_adapter import moe_adapter_problem, peft_target_modules
from trainer.run_model import RunModel, load_run_model
from trainer.rundir import resolve_checkpoint
from trainer.semantics import tokenizer_file
from trainer.targets import UntrustedTargetError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of a source Hugging Face directory that describe the tokenizer and generation, copied as they are.
_COPIED = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Where a LoRA run's export puts the adapters alone (PEFT's format), beside the merged model.
ADAPTER_DIR = "adapter"


def export_family_of(model: Llama, base: dict[str, Any] | None = None) -> str:
    """The Hugging Face family ``model`` is written as (`trainer.models.families.export_family_of`).

    Raises:
        HFError: no family of plait's has the model's features.
    """
    try:
        return families.export_family_of(model, base)
    except FamilyError as err:
        raise HFError(str(err)) from None


def hf_config(model: Llama, base: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A ``config.json`` for ``model``: ``base`` (the config it was loaded from, if any, so ids,
    sliding window and other fields survive) with the architecture fields of ``model``; ``extra``
    fields (token ids, dtype) on top.

    Raises:
        HFError: the model has a feature outside the chosen family.
    """
    family = FAMILIES[export_family_of(model, base)]
    config = dict(base or {})
    config.update(
        architectures=[family.architecture],
        model_type=family.model_type,
        vocab_size=model.vocab_size,
        hidden_size=model.dim,
        intermediate_size=model.ffn_dim,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=model.head_dim,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
    )
    config.update(family.export_fields(model))
    config.setdefault("max_position_embeddings", model.max_seq_len)
    global_rope = {"rope_theta": model.rope_theta, **(model.rope_scaling or {"rope_type": "default"})}
    if model.rope_local_theta is not None or family.local_layers:  # per layer type (Gemma 3)
        # without a local base the windowed blocks rotate with the global tables: say so, or
        # transformers would give them its default base
        local = (
            {"rope_type": "default", "rope_theta": model.rope_local_theta} if model.rope_local_theta else global_rope
        )
        config["rope_parameters"] = {"full_attention": global_rope, "sliding_attention": local}
    elif "rope_parameters" in config or family.sinks:  # the newer layout: keep it (GptOssConfig reads only it)
        config["rope_parameters"] = global_rope
        config.pop("rope_scaling", None)  # a base's pasted block: rope_parameters now holds the model's scaling
    else:
        config.update(rope_theta=model.rope_theta, rope_scaling=model.rope_scaling)
    config.update(extra)
    return config


def hf_state_dict(
    state: dict[str, torch.Tensor], *, tie_embeddings: bool, family: str | None = None
) -> dict[str, torch.Tensor]:
    """Hugging Face names of a full plait state dict (tied ``output.weight`` left out, as HF saves
    it; stacked experts split into one tensor per expert; the expert bias written where the family
    holds it, DeepSeek-V3, else left out: zero, `hf_moe.moe_export_problems`)."""
    out: dict[str, torch.Tensor] = {}
    if family == "gpt_oss":  # its routers and fused expert tensors (trainer.models.hf_gpt_oss)
        out, state = gpt_oss.hf_tensors(state)
    bias = family is not None and FAMILIES[family].moe and holds_expert_bias(family)
    for fqn, tensor in state.items():
        if (tie_embeddings and fqn == "output.weight") or (fqn.endswith("router.expert_bias") and not bias):
            continue
        experts = split_experts(fqn, tensor, family) if family is not None and FAMILIES[family].moe else None
        out.update(experts if experts is not None else {hf_name(fqn, family): tensor.contiguous()})
    return out


def save_weights(state: dict[str, torch.Tensor], directory: str | os.PathLike, *, max_shard_bytes: int) -> list[Path]:
    """Writes Hugging Face-named tensors as ``model.safetensors``, or as shards of at most about
    ``max_shard_bytes`` plus ``model.safetensors.index.json``; returns the files written."""
    directory = Path(directory)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {name: file for file, shard in zip(names, shards) for name in shard},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    for file, shard in zip(names, shards):
        save_file(shard, str(directory / file), metadata={"format": "pt"})
    return [directory / n for n in names]


def write_hf_dir(
    out: str | Path,
    *,
    model: nn.Module,
    state: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    sources: list[Path],
    dtype: str | None = None,
    max_shard_mb: float = 5000.0,
    chat_template: str | None = None,
    config_sources: list[Path] | None = None,
) -> Path:
    """Writes a Hugging Face directory at ``out`` from a full plait state dict (CPU tensors).

    Args:
        model: the plait Llama the state belongs to (its architecture fields make the config).
        sources: directories to copy ``tokenizer_config.json`` and friends from (`source_dirs`).
        dtype: "float32", "bfloat16" or "float16"; None keeps the tensors' dtype.
        chat_template: the template written to ``chat_template.jinja`` (and taken out of
            ``tokenizer_config.json``); None: the first one found in ``sources``
            (`trainer.data.chat_files.find_chat_template`), else plait's default
            (`trainer.data.chat.DEFAULT_CHAT_TEMPLATE`).
        config_sources: the directories whose ``config.json`` the model came from (its base,
            `trainer.hf_sources.base_config`; `source_dirs` with ``tokenizer=False``); None: ``sources``.

    Raises:
        trainer.models.hf.HFError: the model has no Hugging Face architecture.
        trainer.data.chat_files.TemplateFileError: a source's named templates have no default.
    """
    torch_dtype = DTYPES[dtype] if dtype else next(iter(state.values())).dtype
    base = base_config(sources if config_sources is None else config_sources)
    family = export_family_of(model, base)
    named = hf_state_dict(state, tie_embeddings=model.tie_embeddings, family=family)
    # A selection bias stays fp32 (in bf16 its small steps round away), and DeepSeek-V3's router
    # weight with it: transformers keeps both so (FLOAT32_SUFFIXES).
    kept = (*EXPERT_BIAS_SUFFIX, *FLOAT32_SUFFIXES.get(family, ()))
    tensors = {k: v.detach().to("cpu", torch.float32 if k.endswith(kept) else torch_dtype) for k, v in named.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # transformers 5 reads ``dtype`` first (a source saved by it has one) and earlier versions ``torch_dtype``.
    name = str(torch_dtype).removeprefix("torch.")
    extra: dict[str, Any] = {"dtype": name, "torch_dtype": name}
    if chat_template is None:
        found = next((f for f in map(find_chat_template, sources) if f is not None), None)
        chat_template = found.source if found is not None else DEFAULT_CHAT_TEMPLATE
    if base is None:
        # generate() stops at each: the EOS and the template's end of turn (ChatML's <|im_end|>).
        ends = turn_end_ids(tokenizer, JinjaTemplate(chat_template, eos_token=tokenizer.eos_token))
        extra.update(
            eos_token_id=[tokenizer.eos_id, *ends] if ends else tokenizer.eos_id, bos_token_id=None, pad_token_id=None
        )
    (out / "config.json").write_text(json.dumps(hf_config(model, base, **extra), indent=2) + "\n", encoding="utf-8")
    save_weights(tensors, out, max_shard_bytes=int(max_shard_mb * 2**20))
    tokenizer.save(out / "tokenizer.json")
    for name in _COPIED:
        # generation settings belong to the model they came with: not to a tokenizer's folder's model
        where = config_sources if name == "generation_config.json" and config_sources is not None else sources
        found = next((d / name for d in where if (d / name).is_file()), None)
        if found is not None:
            shutil.copyfile(found, out / name)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token, "model_max_length": model.max_seq_len,
    }  # fmt: skip
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_chat_template(out, chat_template)
    return out


def write_peft_adapter(out: str | Path, model: nn.Module, *, dropout: float, base: str | None, family: str) -> Path:
    """Writes the LoRA adapters of ``model`` as a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
    Hugging Face export of the base, adapting exactly the layers plait adapted
    (`trainer.peft_adapter.peft_target_modules`). Format: PEFT's ``LoraConfig`` fields and tensor
    names ``base_model.model.<Hugging Face module>.lora_A.weight`` / ``lora_B.weight``
    (huggingface/peft, ``save_pretrained``).

    Args:
        model: a plait model with adapters (`strategies.transforms.lora.apply_lora`), not merged.
        dropout: the adapters' dropout (saved in the config; inference ignores it).
        base: the base model's path (``base_model_name_or_path``), or None.
        family: the Hugging Face family the base is written as (`export_family_of`).

    Raises:
        HFError: an adapted layer has no Hugging Face name in ``family``, or peft would adapt
            other modules than plait did (`trainer.peft_adapter`); nothing is written then.
    """
    tensors, adapted, ranks, alphas = {}, [], set(), set()
    for fqn, module in adapted_layers(model):
        hf_module = hf_name(f"{fqn}.weight", family).removesuffix(".weight")
        adapted.append(hf_module)
        rank = module.lora_A.weight.shape[0]
        ranks.add(rank)
        alphas.add(module.lora_scaling * rank)
        for name in ("lora_A", "lora_B"):
            tensors[f"base_model.model.{hf_module}.{name}.weight"] = getattr(module, name).weight.detach().contiguous()
    (rank,), (alpha,) = ranks, alphas
    base_state = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    modules = list(
        hf_state_dict(base_state, tie_embeddings=model.tie_embeddings, family=family)
    )  # as the base is written
    problem = moe_adapter_problem(adapted, modules, family)
    if problem:
        raise HFError(
            f"{problem}; train without them (strategy.lora.target_modules), or export the merged model alone (adapter=false)"
        )
    try:
        targets = peft_target_modules(adapted, modules)
    except ValueError as err:
        raise HFError(str(err)) from None
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": str(base) if base else None,
    }  # fmt: skip
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def export_checkpoint(
    path: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    max_shard_mb: float = 5000.0,
    trust: Sequence[str] = (),
    adapter: bool = True,
) -> Path:
    """Loads the model of a run or checkpoint (`trainer.run_model.load_run_model`: one process, any
    saved layout) and writes it with `write_hf_dir`. A LoRA run's model is written with its
    adapters merged into the base, and (``adapter``) the adapters alone in PEFT's format under
    ``out/adapter`` (`write_peft_adapter`).

    Raises:
        FileNotFoundError: ``path`` names no checkpoint, or the run has no tokenizer.json.
        HFError: the run's model class has no Hugging Face mapping (`trainer.capabilities.exportable`),
            a LoRA run's adapters cannot be merged (`strategies.transforms.lora.merge_lora`) or written for
            peft (`write_peft_adapter`).
        UntrustedTargetError, CheckpointError: from `load_run_model` (``trust`` as there).
    """
    run = load_run_model(path, load_base=load_init_from, trust=trust)
    if not exportable(type(run.model)):
        raise HFError(export_problem(type(run.model), f"plait export ckpt={path}"))
    if run.tokenizer is None:
        raise FileNotFoundError(f"{run.run.tokenizer} is missing; a Hugging Face directory needs the run's tokenizer")
    sources, config_sources = source_dirs(run.config), source_dirs(run.config, tokenizer=False)
    if adapted_layers(run.model):  # a LoRA run: its adapter as PEFT's, then merged into the base
        if adapter:
            lora, family = run.config.strategy.lora, export_family_of(run.model, base_config(config_sources))
            base = peft_base(run.config.model.get("init_from"))
            write_peft_adapter(Path(out) / ADAPTER_DIR, run.model, dropout=lora.dropout, base=base, family=family)
        try:
            merge_lora(run.model)
        except ValueError as err:
            written = f" (the adapter alone is in {Path(out) / ADAPTER_DIR})" if adapter else ""
            raise HFError(f"{err}; the merged model is not written{written}") from None
    return write_hf_dir(
        out,
        model=run.model,
        state=run.model.state_dict(),
        tokenizer=run.tokenizer,
        sources=sources,
        dtype=dtype,
        max_shard_mb=max_shard_mb,
        chat_template=trained_chat_template(run).source,
        config_sources=config_sources,
    )


def peft_base(init_from: str | None) -> str | None:
    """The ``base_model_name_or_path`` of a LoRA run's PEFT adapter: ``init_from`` when it is a
    Hugging Face folder; None for a plait run's weights, which no transformers model loads (says
    so on stderr: export that run and load the adapter onto its export)."""
    if init_from and is_hf_dir(init_from):
        return init_from
    if init_from:
        print(
            f"plait: the adapter's base is the plait run {init_from}: its base_model_name_or_path is left empty; "
            f"export that run (plait export ckpt={init_from} out=<dir>) and load the adapter onto the export",
            file=sys.stderr,
        )
    return None


def trained_chat_template(run: RunModel) -> JinjaTemplate:
    """The chat template the run trained with (`plait export` writes it, `plait chat` renders it).

    A run records it at launch (`trainer.rundir.RunDir.write_config`: ``chat_template.jinja``
    beside its ``tokenizer.json``, none for plait's default). A run from before that record has
    no ``tokenizer_config.json``: its template is looked up where its data found it, beside
    ``data.tokenizer`` or ``model.init_from``'s tokenizer (`trainer.semantics.tokenizer_file`),
    unless it chose ``data.template=default``.

    Raises:
        trainer.data.chat.ChatError: the template files are unusable.
    """
    if run.run.tokenizer_config.is_file():
        found = load_chat_template(str(run.run.tokenizer), run.tokenizer)
    else:
        data = run.config.get("data")
        chose_default = data is not None and data.get("template") == "default"
        found = None if chose_default else load_chat_template(tokenizer_file(run.config), run.tokenizer)
    return found or JinjaTemplate(DEFAULT_CHAT_TEMPLATE, origin=DEFAULT_DESCRIPTION, eos_token=run.tokenizer.eos_token)


def main(argv: list[str]) -> None:
    """Entry of ``plait export``: ``key=value`` arguments of conf/export.yaml; exit 2 on bad input."""
    cfg = compose_command("export", argv, usage="plait export ckpt=<run or checkpoint dir> out=<new dir>")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        fail(f"dtype={cfg.dtype} is unknown; use one of {', '.join(DTYPES)} or null (keep the checkpoint's)")
    ckpt = resolve_checkpoint(cfg.ckpt)
    if ckpt is None:
        fail(f"ckpt={cfg.ckpt} names no checkpoint; give a run directory or a step_* checkpoint")
    out = Path(cfg.out).expanduser()
    if out.exists() and any(out.iterdir()):
        fail(f"out={out} is not empty; choose a new directory")
    try:
        export_checkpoint(
            ckpt, out, dtype=cfg.dtype, max_shard_mb=cfg.max_shard_mb, trust=cfg.trust, adapter=cfg.adapter
        )
    except (HFError, FileNotFoundError, UntrustedTargetError, CheckpointError, ChatError, TemplateFileError) as err:
        fail(str(err))
    print(f"plait: wrote {out} (Hugging Face format) from {ckpt}")
