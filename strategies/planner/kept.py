"""The parameter tensors a rank keeps, as the run keeps them: every one trained in
``Workload.param_bytes`` without LoRA; under LoRA (``Workload.lora``) the base frozen, two trained
adapters per adapted weight, and under QLoRA that weight as 4-bit NF4 codes with its quantisation
state (`strategies.transforms.lora`, `strategies.transforms.qlora`). `strategies.planner.memory`
sums their bytes, `strategies.planner.time` their traffic and optimizer work."""

from __future__ import annotations

import math
from typing import NamedTuple

from strategies.core.shape import ModelShape, ParamSpec
from strategies.muon import ADAMW_PARAMS
from strategies.planner.layout import Layout, LoRASpec, Workload
from strategies.planner.ranks import rank_param_counts, rank_params
from strategies.transforms.qlora import BLOCKSIZE, STORAGE


class Kept(NamedTuple):
    """One parameter tensor as a rank keeps it (`kept_tensors`).

    Attributes:
        spec: its name, full shape (QLoRA's codes: their packed storage's), tp dim and block.
        count: alike tensors it stands for (alike blocks counted once, `rank_param_counts`).
        trained: it has a gradient and optimizer state (under LoRA only the adapters do).
        itemsize: bytes per element as kept (``Workload.param_bytes``; QLoRA's codes: ``STORAGE``'s).
        cast: FSDP gathers it in the compute dtype; False for QLoRA's codes, gathered as they are
            (`strategies.fsdp.FSDP.shard_module` with ``cast=False``).
        whole: bytes kept beside it whole on every rank, whatever the sharding: QLoRA's quantisation
            state (`nf4_state_bytes`), on the module, not a parameter.
    """

    spec: ParamSpec
    count: int
    trained: bool
    itemsize: int
    cast: bool = True
    whole: int = 0


def kept_tensors(shape: ModelShape, layout: Layout, work: Workload, pp_rank: int) -> list[Kept]:
    """The parameter tensors of a pp rank (`rank_params`) as the run keeps them.

    Without LoRA every tensor trains, in ``Workload.param_bytes``. LoRA (``Workload.lora``,
    `strategies.transforms.lora.apply_lora`) freezes every parameter and gives each adapted weight
    [out, in] two trained adapters of its dtype (`adapter_specs`); QLoRA stores that weight as
    NF4 codes (`nf4_codes`) with its quantisation state. Alike blocks count once
    (`rank_param_counts`) unless a name decides per tensor (LoRA's targets may name single blocks,
    ``layers.0.*``; so may a custom Muon split, ``Workload.adamw_params``): then each tensor once.
    """
    lora, pb = work.lora, work.param_bytes
    by_kind = lora is None and (work.optimizer != "muon" or work.adamw_params == ADAMW_PARAMS)
    pairs = (
        rank_param_counts(shape, layout, pp_rank) if by_kind else [(p, 1) for p in rank_params(shape, layout, pp_rank)]
    )
    if lora is None:
        return [Kept(p, n, True, pb) for p, n in pairs]
    out = []
    for p, n in pairs:
        if not lora.adapts(p):
            out.append(Kept(p, n, False, pb))
            continue
        if lora.quantize is None:
            out.append(Kept(p, n, False, pb))
        else:
            out.append(Kept(nf4_codes(p), n, False, STORAGE.itemsize, cast=False, whole=nf4_state_bytes(p)))
        out += [Kept(a, n, True, pb) for a in adapter_specs(p, lora)]
    return out


def adapter_specs(p: ParamSpec, lora: LoRASpec) -> tuple[ParamSpec, ParamSpec]:
    """LoRA's A [r, in] and B [out, r] of an adapted weight ``p`` [out, in], sharded by tensor
    parallelism as `strategies.transforms.lora` places them: a column-wise weight (tp dim 0) keeps A
    whole and shards B's rows, a row-wise one (tp dim 1) shards A's columns and keeps B whole."""
    layer, (out, features) = p.name.removesuffix(".weight"), p.shape
    a = ParamSpec(f"{layer}.lora_A.weight", (lora.rank, features), 1 if p.tp_dim == 1 else None, p.layer)
    b = ParamSpec(f"{layer}.lora_B.weight", (out, lora.rank), 0 if p.tp_dim == 0 else None, p.layer)
    return a, b


def nf4_codes(p: ParamSpec) -> ParamSpec:
    """The parameter QLoRA keeps for weight ``p`` (`strategies.transforms.qlora.NF4Linear`): its n
    weights as 4-bit codes, two a byte, in ``STORAGE`` elements: bitsandbytes' ``quantize_4bit``
    returns [(n + 1) // (2 x itemsize), 1] (float32: n / 8 elements, n / 2 bytes). FSDP2 shards
    them like any parameter; QLoRA refuses tensor parallelism."""
    n = math.prod(p.shape)
    return ParamSpec(p.name, ((n + 1) // (2 * STORAGE.itemsize), 1), None, p.layer)


def nf4_state_bytes(p: ParamSpec) -> int:
    """Bytes of the quantisation state QLoRA keeps for weight ``p`` on its module (a bitsandbytes
    ``QuantState``, whole on every rank): one float32 absmax per ``BLOCKSIZE`` weights (no double
    quantisation: ``compress_statistics=False``) and the 16-entry float32 NF4 code book."""
    return 4 * -(-math.prod(p.shape) // BLOCKSIZE) + 16 * 4
