"""What a model must offer for the features a config turns on, checked in `trainer.config.validate`.

A model of one's own (``model._target_=my_pkg.MyModel``) trains with every layout that needs
nothing more from it than ``layers`` and ``forward`` (DDP, FSDP2); other features read the model
itself (README "Your own model"):

- tensor, context and pipeline parallelism (``strategy.tp/cp/pp > 1``) read the members of the
  declared contract `strategies.core.model_contract.NEEDS` (the sizes; ``tp_plan`` unless the strategy's
  ``tensor_parallel`` plugin overrides ``plan``; ``set_attention_core``; the stage modules);
- a Hugging Face export (``callbacks.hf_export``, ``plait export``) maps the classes of the
  family registry (`trainer.models.families`) onto Hugging Face's: a model of another class has
  no such mapping.

Without them a run failed after launch (``LayoutError`` in ``parallelize``, an ``AttributeError``
in the export); here they are config problems that name the fix.
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from strategies.core.model_contract import layout_problems
from strategies.core.resolved import ResolvedRun
from strategies.tensor import TensorParallel
from trainer.hf_sources import base_config, source_dirs
from trainer.models.families import EXPORTABLE, FamilyError, export_family_of, exportable
from trainer.models.llama import Llama
from trainer.models.moe_transformer import MoETransformer


def _class(node: Any) -> type | None:
    """The class a node's ``_target_`` names; None for a factory function (``model=hf``'s
    ``llama_from_hf``: its model is checked when built) or a target that does not import (reported by
    the target checks). Imported directly: Hydra's ``get_class`` logs an error for a function."""
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return None
    module, _, name = node._target_.rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return target if isinstance(target, type) else None


def export_problem(model_cls: type, where: str) -> str:
    """The message for a model ``where`` asks to export that has no Hugging Face mapping."""
    return (
        f"{where}: {model_cls.__module__}.{model_cls.__qualname__} has no Hugging Face mapping (plait exports "
        f"subclasses of {' and '.join(f'{c.__module__}.{c.__qualname__}' for c in EXPORTABLE)}, the classes of "
        "trainer.models.families); subclass one of them, or load checkpoints/ with "
        "trainer.run_model.load_run_model and save the weights yourself"
    )


def contract_problems(cfg: DictConfig, run: ResolvedRun | None, model: Any = None) -> list[str]:
    """The members the resolved layout reads that the model does not declare
    (`strategies.core.model_contract.layout_problems`), each named with how to add it.

    Args:
        model: the model of ``cfg`` built on the meta device; None when it could not be built
            (then its class is checked for the members a class declares).
    """
    model = model if model is not None else _class(cfg.get("model"))
    if model is None or run is None:
        return []
    strategy = cfg.get("strategy")
    plugin = _class(strategy.get("tensor_parallel")) if isinstance(strategy, DictConfig) else None
    default_plan = plugin is None or plugin.plan is TensorParallel.plan
    degrees = {"tp": run.dims.tp, "cp": run.dims.cp, "pp": run.dims.pp}
    return layout_problems(model, degrees, tp_plan=default_plan)


def capability_problems(cfg: DictConfig, run: ResolvedRun | None) -> list[str]:
    """The features ``cfg`` turns on that its model class does not support (a Hugging Face export), with the fix."""
    model_cls = _class(cfg.get("model"))
    if model_cls is None:
        return []
    problems = []
    export = OmegaConf.select(cfg, "callbacks.hf_export", throw_on_missing=False)
    if isinstance(export, DictConfig) and (export.get("at_end") or (export.get("every_n_steps") or 0) > 0):
        if not exportable(model_cls):
            problems.append(export_problem(model_cls, "callbacks.hf_export") + "; or callbacks.hf_export.at_end=false")
    return problems


def export_fit_problems(cfg: DictConfig, model: Any) -> list[str]:
    """``callbacks.hf_export`` on a model (built on the meta device) that fits no Hugging Face family
    plait writes, or not its source's (`trainer.models.families.export_family_of`: a mixture of
    experts with shared experts or dense blocks does not fit Mixtral): refused here, not as a
    traceback after training."""
    export = OmegaConf.select(cfg, "callbacks.hf_export", throw_on_missing=False)
    if not isinstance(export, DictConfig) or not (export.get("at_end") or (export.get("every_n_steps") or 0) > 0):
        return []
    if not isinstance(model, EXPORTABLE):
        return []  # capability_problems names the class
    try:
        export_family_of(model, base_config(source_dirs(cfg, tokenizer=False)))
    except FamilyError as err:
        return [f"callbacks.hf_export: {err}; set callbacks.hf_export.at_end=false and every_n_steps=0"]
    return []


def window_problems(run: ResolvedRun | None, model: Any) -> list[str]:
    """Sliding windows (Gemma 3, GPT-OSS) shorter than the rows, or attention sinks (GPT-OSS), under a
    layout whose attention does not apply them: context parallelism's cores attend over the whole
    document with a plain softmax (`trainer.models.llama`)."""
    if run is None or not isinstance(model, Llama) or run.dims.cp <= 1:
        return []
    problems = []
    if model.attention_sinks:
        problems.append(
            f"strategy.cp={run.dims.cp}: the model's attention sinks (model.attention_sinks=true, GPT-OSS) join each "
            "softmax's denominator, which context parallelism's ring and all-to-all attention do not compute; use "
            "strategy.cp=1"
        )
    if not model.window_layers or run.seq_len <= model.sliding_window:
        return problems
    return problems + [
        f"strategy.cp={run.dims.cp}: model.sliding_window={model.sliding_window} is shorter than data.seq_len="
        f"{run.seq_len}, and context parallelism's attention does not apply sliding windows; use strategy.cp=1 "
        f"or data.seq_len<={model.sliding_window}"
    ]


def latent_attention_problems(run: ResolvedRun | None, model: Any) -> list[str]:
    """Multi-head latent attention (DeepSeek-V3) under context parallelism: the ring and all-to-all
    cores carry keys and values of one head width, latent attention's values are narrower
    (``v_head_dim``) than its queries and keys; not built."""
    if run is None or run.dims.cp <= 1 or not isinstance(model, MoETransformer) or not model.latent_attention:
        return []
    mla = model.latent_attention
    return [
        f"strategy.cp={run.dims.cp}: context parallelism is not built for latent attention "
        f"(model.latent_attention: keys of {mla['qk_nope_head_dim'] + mla['qk_rope_head_dim']} features, values of "
        f"{mla['v_head_dim']}); use strategy.cp=1 (tp, pp, fsdp and expert parallelism apply)"
    ]
