"""Which modules a PEFT LoRA adapter names, so that ``peft`` adapts exactly the layers plait adapted.

PEFT reads ``target_modules`` (a list) as: adapt each module whose name equals an entry or ends
in ``.<entry>`` (huggingface/peft, ``tuners_utils.check_target_module_exists``). Short names are
what users write (``q_proj`` adapts every layer's), but a short name for a layer adapted in only
some blocks (``strategy.lora.target_modules=[layers.0.*]``) would also adapt the others, which
plait never trained. `peft_target_modules` keeps a short name only where it selects exactly the
adapted modules, and names the rest in full.

PEFT with transformers >= 5 also rewrites the names of some mixture-of-experts families before
matching (``peft/utils/transformers_weight_conversion.py``): a Qwen3-MoE ``gate_proj``,
``up_proj`` or ``down_proj`` entry becomes the experts' fused projection and a router ``gate``
entry every block's router weight. `moe_adapter_problem` names the adapters that would land
elsewhere because of it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

# Module leaves PEFT maps, per family, onto the experts' fused projections (whatever the block)
# and onto every block's router weight (the ``gate`` entry).
# MLP leaves that peft (transformers >= 5) maps onto the routed experts' fused tensors, per family
# (DeepSeek-V3: its dense blocks' and shared experts' gate/up/down_proj too, as for Qwen3-MoE).
_EXPERT_LEAVES = {
    "qwen3_moe": {"gate_proj", "up_proj", "down_proj"},
    "deepseek_v3": {"gate_proj", "up_proj", "down_proj"},
    "mixtral": {"w1", "w2", "w3"},
}
_ROUTER_FAMILIES = ("qwen3_moe", "mixtral")  # whose every block's router peft adapts, or none
_ROUTER_LEAF = "gate"
# Whose router is no layer peft adapts (GPT-OSS's GptOssTopKRouter: "Target module ... is not supported").
_UNADAPTABLE_ROUTERS = {"gpt_oss": ("router", "GptOssTopKRouter")}  # family: (its router's leaf, class)


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def peft_target_modules(adapted: Collection[str], modules: Iterable[str]) -> list[str]:
    """PEFT ``target_modules`` that select exactly the ``adapted`` modules among ``modules``.

    A kind of module (``q_proj``) adapted wherever it occurs is written by its short name, so the
    common case (every block) reads as usual; the other adapted modules by their full names
    (``model.layers.0.self_attn.q_proj``), which only they equal.

    Args:
        adapted: Hugging Face names of the modules that carry adapters.
        modules: Hugging Face names of the model's tensors or modules (their ancestors count too).

    Returns:
        The entries, sorted.

    Raises:
        ValueError: the entries would select other modules too (one module's full name ending
            another's path), so no list reproduces the adapted set.
    """
    universe = {prefix for name in [*modules, *adapted] for prefix in _prefixes(name)}
    reach = lambda entry: {m for m in universe if m == entry or m.endswith("." + entry)}  # noqa: E731
    targets: list[str] = []
    for kind in sorted({_leaf(name) for name in adapted}):
        of_kind = {name for name in adapted if _leaf(name) == kind}
        targets += [kind] if reach(kind) == of_kind else sorted(of_kind)
    extra = set().union(*map(reach, targets)) - set(adapted) if targets else set()
    if extra:
        raise ValueError(
            f"no PEFT target_modules select exactly the adapted modules; they would also adapt {sorted(extra)}"
        )
    return sorted(targets)


def moe_adapter_problem(adapted: Collection[str], modules: Iterable[str], family: str) -> str | None:
    """Why PEFT (with transformers >= 5) would put the ``adapted`` modules of a ``family`` model
    elsewhere, or None: an adapted dense-block MLP projection (PEFT adapts the experts instead) or
    routers adapted in some blocks only (PEFT adapts every block's router), or a router PEFT
    cannot adapt at all (GPT-OSS's)."""
    dense = sorted(name for name in adapted if _leaf(name) in _EXPERT_LEAVES.get(family, ()))
    if dense:
        return (
            f"peft (with transformers >= 5) reads {', '.join(sorted({_leaf(n) for n in dense}))} of a {family} model as the "
            f"experts' fused projections, so the adapters on {', '.join(dense)} would load onto the experts"
        )
    leaf, router_class = _UNADAPTABLE_ROUTERS.get(family, ("", ""))
    if routed := sorted(n for n in adapted if leaf and _leaf(n) == leaf):
        return (
            f"peft cannot adapt a {family} model's router ({router_class} is no layer it supports), "
            f"and {', '.join(routed[:2])}{' ...' if len(routed) > 2 else ''} carry adapters"
        )
    if family not in _ROUTER_FAMILIES:
        return None
    routers = {p for name in modules for p in _prefixes(name) if _leaf(p) == _ROUTER_LEAF}
    adapted_routers = {name for name in adapted if _leaf(name) == _ROUTER_LEAF}
    if adapted_routers and adapted_routers != routers:
        return (
            f"peft (with transformers >= 5) adapts every block's router of a {family} model or none, "
            f"and only {', '.join(sorted(adapted_routers))} of {len(routers)} routers carry adapters"
        )
    return None
