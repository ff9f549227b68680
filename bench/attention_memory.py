"""Saved-for-backward bytes of one packed row through the tiny Llama, by sequence length (CPU).

Counts, with ``torch.autograd.graph.saved_tensors_hooks``, the bytes of every distinct storage
autograd saves during the forward and the cross-entropy of one packed row ``[1, T]`` (nothing
runs backward), for plait's attention (document-causal
kernels, `trainer.models.attention.DocumentCausalAttention`) and, side by side up to
``--dense-max``, for the dense-mask SDPA it replaced (one ``[1, 1, T, T]`` mask, SDPA saves it as an
additive bias in every layer). The row packs documents whose lengths are drawn once from a
log-normal law (median 300 tokens, fixed seed), as a corpus of short documents gives.

    python bench/attention_memory.py                    # T = 4096, 8192, 16384; ~1 min on 2 cores
    python bench/attention_memory.py --lengths 2048 4096 --dense-max 4096

Target (issue 15): bytes grow by at most 2.2x per doubling of T. The last line is
``RESULT growth_max=<x> ...``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from trainer.models.document_masks import block_causal_mask
from trainer.models.llama import Llama

TINY = dict(vocab_size=4096, dim=192, n_layers=4, n_heads=6, n_kv_heads=2)  # conf/model/tiny.yaml


class DenseMaskSDPA:
    """The attention core plait had before its document kernels: k/v repeated, a dense boolean mask."""

    def mask(self, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device) -> torch.Tensor | None:
        return None if document_ids_bt is None else block_causal_mask(document_ids_bt)

    def __call__(self, q, k, v, mask):  # noqa: ANN001, ANN204
        rep = q.shape[2] // k.shape[2]
        q, k, v = (
            q.transpose(1, 2),
            k.repeat_interleave(rep, 2).transpose(1, 2),
            v.repeat_interleave(rep, 2).transpose(1, 2),
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def packed_row(seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document_ids, position_ids)`` ``[1, T]`` of documents with log-normal lengths (median 300)."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_len:
        n = int(torch.empty(1).log_normal_(mean=5.7, std=1.0, generator=g).clamp(min=1))
        lengths.append(min(n, seq_len - total))
        total += lengths[-1]
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    return docs[None], pos[None]


def saved_bytes(model: Llama, seq_len: int) -> int:
    """Bytes of the distinct storages saved for backward by one forward + loss of a packed row."""
    docs, pos = packed_row(seq_len)
    ids = torch.randint(0, model.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    # Storages are held until counted (as backward would hold them), so no address is reused.
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> None:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        logits = model(ids, position_ids_bt=pos, document_ids_bt=docs)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    return sum(s.nbytes() for s in seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--dense-max", type=int, default=8192, help="longest T for the dense-mask arm")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Llama(**TINY, max_seq_len=max(args.lengths))
    rows = {}
    for arm, core in (("plait", None), ("dense_mask", DenseMaskSDPA())):
        if core is not None:
            model.set_attention_core(core)
        rows[arm] = {T: saved_bytes(model, T) for T in args.lengths if core is None or T <= args.dense_max}
    print(f"{'T':>7} {'plait MiB':>10} {'growth':>7} {'dense-mask MiB':>15} {'growth':>7}")
    growth: dict[str, list[float]] = {"plait": [], "dense_mask": []}
    for i, T in enumerate(args.lengths):
        cells = []
        for arm in ("plait", "dense_mask"):
            b, prev = rows[arm].get(T), rows[arm].get(args.lengths[i - 1]) if i else None
            g = b / prev if b and prev else None
            if g:
                growth[arm].append(g)
            cells += [f"{b / 2**20:.1f}" if b else "-", f"{g:.2f}x" if g else "-"]
        print(f"{T:>7} {cells[0]:>10} {cells[1]:>7} {cells[2]:>15} {cells[3]:>7}")
    plait_mib = " ".join(f"plait_mib_{T}={rows['plait'][T] / 2**20:.1f}" for T in args.lengths)
    dense = max(growth["dense_mask"], default=float("nan"))
    print(f"RESULT growth_max={max(growth['plait']):.3f} {plait_mib} dense_mask_growth_max={dense:.3f}")


if __name__ == "__main__":
    main()
