"""RoPE frequency tables, with the context-extension scalings of published checkpoints.

Sources: Su et al. 2021, "RoFormer" (RoPE); Chen et al. 2023, "Extending Context Window of Large
Language Models via Positional Interpolation" (``linear``); Llama Team 2024, "The Llama 3 Herd of
Models" and Meta's Llama 3.1 reference code (``llama3``: wavelength-dependent interpolation);
Peng et al. 2023, "YaRN" (``yarn``: NTK-by-parts interpolation plus an attention temperature).
The formulas are the ones Hugging Face ``transformers`` uses for these ``rope_type`` names, so a
checkpoint's ``rope_scaling`` means the same thing here.

A scaling is a plain dict, ``{"rope_type": <name>, ...}`` (Hugging Face's ``type`` is accepted too).
"dynamic" NTK scaling is not supported: its tables depend on the length of the running sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

# rope_type -> (required keys, optional keys).
ROPE_TYPES: dict[str, tuple[set[str], set[str]]] = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, set()),
    "yarn": (
        {"factor", "original_max_position_embeddings"},
        {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    ),
}
# Keys a checkpoint's scaling dict may carry that do not change the tables.
_IGNORED = {"type", "rope_type", "rope_theta"}


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The scaling's name: ``rope_type`` (or Hugging Face's older ``type``), "default" for None."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_scaling_problems(scaling: Mapping[str, Any] | None, where: str = "model.rope_scaling") -> list[str]:
    """Problems of a scaling dict, each naming the field; [] when it is supported."""
    name = rope_type(scaling)
    if name not in ROPE_TYPES:
        return [
            f"{where}.rope_type={name!r} is not supported; supported: {', '.join(ROPE_TYPES)} "
            f"({'dynamic NTK scaling depends on the running sequence length' if name == 'dynamic' else 'see trainer/models/rope.py'})"
        ]
    required, optional = ROPE_TYPES[name]
    keys = set(scaling or {})
    problems = [f"{where}.{k} is required by rope_type={name}" for k in sorted(required - keys)]
    problems += [
        f"{where}.{k} is not a field of rope_type={name}" for k in sorted(keys - required - optional - _IGNORED)
    ]
    if "factor" in keys and not (isinstance(scaling["factor"], (int, float)) and scaling["factor"] >= 1):
        problems.append(f"{where}.factor={scaling['factor']!r} must be a number >= 1")
    return problems


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: extrapolate the fast dims, interpolate the slow ones, ramp between; temperature mscale."""
    factor, original = float(s["factor"]), s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        both = s.get("mscale") and s.get("mscale_all_dim")
        attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]) if both else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention)


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 cos/sin tables for RoPE, each ``[max_seq_len, head_dim // 2]``.

    Frequency ``i`` is ``theta ** (-2i / head_dim)``, changed by ``scaling``; row ``p`` holds the
    angles ``p * freq`` (times YaRN's attention factor, which scales both q and k).

    Raises:
        ValueError: an unsupported scaling (see `rope_scaling_problems`).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    name, factor = rope_type(scaling), 1.0
    if name != "default":
        problems = rope_scaling_problems(scaling)
        if problems:
            raise ValueError("; ".join(problems))
    if name == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif name == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif name == "yarn":
        inv_freq, factor = _yarn(inv_freq, head_dim, theta, scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles_tf = torch.outer(positions, inv_freq)
    return angles_tf.cos() * factor, angles_tf.sin() * factor
