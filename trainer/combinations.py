"""Components that validate accepts one by one but that cannot run together: refused before launch,
naming the fix (`trainer.config.component_problems` lists them beside each component's own)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from strategies.local_sgd.ist import IST
from trainer.semantics import _import


def target_class(node: Any) -> Any:
    """The class a ``_target_`` node builds; None for another value or a target that does not
    import (the target checks report that)."""
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return None
    try:
        return _import(node._target_)
    except (ImportError, AttributeError, ValueError):
        return None


def driver_problems(cfg: DictConfig) -> list[str]:
    """What a driver of runs of its own (``budget=msft``'s roll-outs, ``plait rest``'s rounds) cannot
    run with: it reads its runs' checkpoints (a roll-back point, each round's model), so it needs
    them and one model in each (not local SGD's islands; IST's for rest's rounds, whose last step
    reassembles it), and it fits its runs in children of its own process, not as torchft's replica
    groups (whose launcher the train command starts)."""
    drivers = [what for key, what in (("budget", "budget=msft"), ("rest", "plait rest")) if cfg.get(key) is not None]
    problems = []
    if len(drivers) == 2:
        problems.append("budget=msft and plait rest each drive runs of their own; choose one (drop +budget=msft)")
    for what in drivers:
        if OmegaConf.select(cfg, "callbacks.checkpoint", default=None) is None:
            problems.append(
                f"{what} reads the checkpoints of the runs it drives (roll-backs, each round's model); drop "
                "callbacks.checkpoint=null"
            )
        if OmegaConf.select(cfg, "strategy.fault_tolerance", default=None) is not None:
            problems.append(
                f"{what} fits its runs in processes of its own, not as torchft replica groups; use a strategy without "
                "strategy.fault_tolerance (strategy=ddp or fsdp, not ft or ft_diloco)"
            )
        elif (local_sgd := OmegaConf.select(cfg, "strategy.local_sgd", default=None)) is not None and not (
            what == "plait rest" and _is_ist(local_sgd)  # IST reassembles at a round's last step, before its save
        ):
            # a reviewer: budget=msft under strategy=diloco handed over a roll-back point whose islands differed
            problems.append(
                f"{what} takes its runs' models from their checkpoints (a roll-back point at an evaluation, each "
                "round's last step), where local SGD's islands hold their own weights; use strategy=ddp or fsdp "
                "(strategy.local_sgd=null)"
            )
    return problems


def _is_ist(local_sgd: Any) -> bool:
    """Whether a ``strategy.local_sgd`` node builds Independent Subnet Training (or a subclass)."""
    cls = target_class(local_sgd)
    return isinstance(cls, type) and issubclass(cls, IST)


def subnet_problems(cfg: DictConfig) -> list[str]:
    """Callbacks that read the whole model while Independent Subnet Training trains narrower MLPs
    between its reassemblies (`strategies.local_sgd.ist`): a Hugging Face export in the middle of a
    round (its MLP weights one island's hidden units, config.json the full width), an lm-eval score
    there (of one island's subnet), and PAFT's ``delta_l1``, whose step-0 copy is full width."""
    local_sgd = OmegaConf.select(cfg, "strategy.local_sgd", default=None)
    if not _is_ist(local_sgd):
        return []
    every = int(local_sgd.get("sync_every") or 1)
    problems = []
    export = int(OmegaConf.select(cfg, "callbacks.hf_export.every_n_steps", default=0) or 0)
    last = int(OmegaConf.select(cfg, "trainer.max_steps", default=0) or 0)
    # off the rounds, the first export is mid-round unless it is the last step's (reassembled at the end)
    if export and export % every and export < last:
        problems.append(
            f"callbacks.hf_export.every_n_steps={export} exports in the middle of an IST round, whose MLPs hold one "
            f"island's hidden units; use a multiple of strategy.local_sgd.sync_every={every}"
        )
    scored = int(OmegaConf.select(cfg, "callbacks.lm_eval.every_n_steps", default=0) or 0)
    if scored and scored % every and scored < last:
        problems.append(
            f"callbacks.lm_eval.every_n_steps={scored} scores in the middle of an IST round, whose MLPs hold one "
            f"island's hidden units; use a multiple of strategy.local_sgd.sync_every={every}"
        )
    if OmegaConf.select(cfg, "callbacks.delta_l1", default=None) is not None:
        problems.append(
            "callbacks.delta_l1 pulls every weight toward its full-width value at step 0, and IST trains narrower MLPs "
            "between reassemblies; use another strategy (e.g. strategy=diloco) or drop callbacks.delta_l1"
        )
    return problems


def island_bias_problems(cfg: DictConfig) -> list[str]:
    """DeepSeek-V3's expert bias (``model.bias_update_rate > 0``, `trainer.callbacks.expert_bias`)
    under local SGD: each island moves its routers' bias from its own tokens and the outer step
    averages parameters, not that buffer, so the islands route differently after a synchronisation
    and a run's export takes island 0's bias (a reviewer's DiLoCo run: every MoE block's bias
    differed at a synchronised step)."""
    rate = OmegaConf.select(cfg, "model.bias_update_rate", default=0) or 0
    local_sgd = OmegaConf.select(cfg, "strategy.local_sgd", default=None)
    if not rate or local_sgd is None or OmegaConf.select(cfg, "callbacks.expert_bias", default=None) is None:
        return []
    return [
        f"model.bias_update_rate={rate} moves each island's expert bias from its own tokens under strategy.local_sgd, "
        "whose synchronisations average parameters, not the bias: set model.bias_update_rate=0 (and balance with "
        "model.balance_coef), or train without local SGD"
    ]
