"""Which layers LoRA adapts: ``strategy.lora.target_modules`` patterns against a model's linear layers.

A pattern selects a layer FQN equal to it, ending in ``.<pattern>`` (PEFT's rule: ``wq`` selects
every ``layers.*.attention.wq``), or matching it as an ``fnmatch`` glob of the whole FQN
(``layers.0.*``), by plait's name or by the layer's Hugging Face name (`strategies.core.hf_names`),
which is what PEFT's ``target_modules`` hold: ``q_proj`` selects every ``layers.*.attention.wq``,
``model.layers.0.self_attn.q_proj`` only block 0's. Every pattern must select a layer (`target_problems`: a dead pattern is a typo or
another model's name, never one to skip in silence), and the stacked routed experts of a mixture
of experts, parameters rather than ``nn.Linear`` layers, are named when a pattern names them
(`unadaptable`). The adapters' own parameters are ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight``
(`is_adapter`), PEFT's names.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from strategies.core.hf_names import LATENT_LAYER_NAMES, hf_module_name
from strategies.expert.dispatch import EXPERT_WEIGHTS, StackedExperts

ADAPTER_NAMES = ("lora_A", "lora_B")


def is_adapter(fqn: str) -> bool:
    """True for the parameter names of LoRA adapters (``...wq.lora_A.weight``)."""
    return any(f".{name}." in f".{fqn}" for name in ADAPTER_NAMES)


def selects(name: str, pattern: str) -> bool:
    """Whether ``pattern`` of ``strategy.lora.target_modules`` selects the layer FQN ``name``: equal
    to it, ending in ``.<pattern>`` (PEFT's rule: ``wq`` selects every ``layers.*.attention.wq``), or
    an ``fnmatch`` glob of the whole FQN (``layers.0.*``; case-sensitive on every platform); the same
    against the layer's Hugging Face names (``q_proj``, ``mlp.*``; latent attention's ``q_a_proj``,
    ``kv_b_proj``: `hf_module_name`)."""
    return any(
        candidate == pattern or candidate.endswith("." + pattern) or fnmatchcase(candidate, pattern)
        for candidate in (name, *_hf_names(name))
    )


def _hf_names(name: str) -> list[str]:
    """The Hugging Face names of plait layer ``name``: Llama's table, and latent attention's (DeepSeek-V3)."""
    names = (hf_module_name(name), hf_module_name(name, LATENT_LAYER_NAMES))
    return [hf for hf in dict.fromkeys(names) if hf is not None]


def target_problems(names: Sequence[str], target_modules: Sequence[str]) -> list[str]:
    """A message naming the patterns of ``target_modules`` that select none of ``names`` (a model's
    ``nn.Linear`` FQNs) and the layers there are; empty when every pattern selects one. A pattern
    that selects nothing is a typo or another model's name (``q_proj``), never one to skip in silence."""
    dead = [pattern for pattern in target_modules if not any(selects(n, pattern) for n in names)]
    if not dead:
        return []
    kinds = sorted({n.rpartition(".")[2] for n in names})
    hf_kinds = sorted({hf.rpartition(".")[2] for n in names for hf in _hf_names(n)})
    example = next((n for n in names if n.startswith("layers.0.")), names[0] if names else "")
    return [
        f"strategy.lora.target_modules: {', '.join(map(repr, dead))} {'matches' if len(dead) == 1 else 'match'} no linear "
        f"layer; the model has {kinds}"
        + (f" (Hugging Face/PEFT names: {hf_kinds})" if hf_kinds else "")
        + f" (full names such as {example!r}, or globs such as 'layers.0.*')"
    ]


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of ``model`` that can carry adapters (adapters themselves excluded)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not is_adapter(n + ".")]


def target_names(names: Sequence[str], target_modules: Sequence[str]) -> list[str]:
    """The layer FQNs of ``names`` that a pattern of ``target_modules`` selects (`selects`), in order:
    what `lora_targets` adapts of a model, and what the planner counts adapters for (from the
    ``linear_modules`` of a `strategies.core.shape.ModelShape`)."""
    return [n for n in names if any(selects(n, p) for p in target_modules)]


def lora_targets(model: nn.Module, target_modules: tuple[str, ...] | list[str]) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules a pattern of ``target_modules`` selects (`target_names`), in module order."""
    layers = linear_layers(model)
    chosen = set(target_names([n for n, _ in layers], target_modules))
    return [(n, m) for n, m in layers if n in chosen]


def unadaptable(model: nn.Module, target_modules: tuple[str, ...] | list[str]) -> list[str]:
    """The stacked routed-expert weights (``...experts.w1`` ``[E, out, in]``, `StackedExperts`) that
    ``target_modules`` names: parameters, not ``nn.Linear`` layers, so `apply_lora` adapts none of them."""
    return [
        f"{name}.{w}" for name, m in model.named_modules() if isinstance(m, StackedExperts) for w in EXPERT_WEIGHTS
        if any(selects(f"{name}.{w}", p) for p in target_modules)
    ]  # fmt: skip
