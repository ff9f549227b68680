"""What a model must offer for the features a config turns on, checked in `trainer.config.validate`.

A model of one's own (``model._target_=my_pkg.MyModel``) trains with every layout that needs
nothing from it (DDP, FSDP2, pipeline stages through its ``layers``); two features read the model
itself (README "Your own model"):

- tensor parallelism (``strategy.tp > 1``) applies the plan the model declares, a ``tp_plan``
  method (`trainer.models.llama.Llama.tp_plan`), unless the strategy's ``tensor_parallel`` plugin
  overrides ``plan``;
- a Hugging Face export (``callbacks.hf_export``, ``plait export``) maps plait's Llama and
  mixture-of-experts modules onto Hugging Face's (`trainer.export`): a model of another class
  has no such mapping.

Without them a run failed after launch (``LayoutError`` in ``parallelize``, an ``AttributeError``
in the export); here they are config problems that name the fix.
"""

from __future__ import annotations

from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from strategies.resolved import ResolvedRun
from strategies.tensor import TensorParallel

EXPORTABLE = ("trainer.models.llama.Llama", "trainer.models.moe_transformer.MoETransformer")


def _class(node: Any) -> type | None:
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return None
    try:
        return get_class(node._target_)
    except Exception:  # noqa: BLE001 - an unimportable target is reported by the target checks
        return None


def exportable(model_cls: type) -> bool:
    """Whether plait can write a model of ``model_cls`` as a Hugging Face directory (`EXPORTABLE`)."""
    return any(issubclass(model_cls, get_class(name)) for name in EXPORTABLE)


def export_problem(model_cls: type, where: str) -> str:
    """The message for a model ``where`` asks to export that has no Hugging Face mapping."""
    return (
        f"{where}: {model_cls.__module__}.{model_cls.__qualname__} has no Hugging Face mapping (plait exports "
        f"subclasses of {' and '.join(EXPORTABLE)}); subclass one of them, or load checkpoints/ with "
        "trainer.rundir.load_run_model and save the weights yourself"
    )


def capability_problems(cfg: DictConfig, run: ResolvedRun | None) -> list[str]:
    """The features ``cfg`` turns on that its model class does not support, each with the fix."""
    model_cls = _class(cfg.get("model"))
    if model_cls is None:
        return []
    problems = []
    strategy = cfg.get("strategy")
    plugin = _class(strategy.get("tensor_parallel")) if isinstance(strategy, DictConfig) else None
    default_plan = plugin is None or plugin.plan is TensorParallel.plan
    if run is not None and run.dims.tp > 1 and default_plan and not callable(getattr(model_cls, "tp_plan", None)):
        problems.append(
            f"strategy.tp={run.dims.tp}: {model_cls.__qualname__} declares no tensor-parallel plan; add a "
            "tp_plan(sequence_parallel, loss_parallel) method (see trainer.models.llama.Llama.tp_plan), override "
            "strategies.tensor.TensorParallel.plan (strategy.tensor_parallel._target_=...), or use strategy.tp=1"
        )
    export = OmegaConf.select(cfg, "callbacks.hf_export", throw_on_missing=False)
    if isinstance(export, DictConfig) and (export.get("at_end") or (export.get("every_n_steps") or 0) > 0):
        if not exportable(model_cls):
            problems.append(export_problem(model_cls, "callbacks.hf_export") + "; or callbacks.hf_export.at_end=false")
    return problems
