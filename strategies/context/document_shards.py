"""Document-aware context-parallel sharding of packed rows: a zigzag per document.

Zigzag sharding (`strategies.context.sharding.shard_positions`) cuts a row into ``2 cp`` chunks and gives
rank r chunks r and ``2cp - 1 - r``: exact balance of causal work for a row of one document. A
packed row holds many documents and attention never crosses one, so a token's work is its index
in its document plus one; a rank whose chunks hold the starts of documents does less. Measured on
packed rows of random documents: max/mean 1.19 at cp=2, 1.27 at cp=4 (bench/cp_shards.py).

Here every document is cut into ``2 cp`` near-equal consecutive pieces and piece k of every
document goes to zigzag chunk k (the pieces of a chunk in document order): each rank then holds
pieces r and ``2cp - 1 - r`` of every document, the zigzag balance per document (the idea of
per-document head/tail chunks in ByteScale, Ge et al. 2025, and Zeppelin, 2025). When a
document's length is not a multiple of ``2 cp`` its extra tokens go to the next chunks in turn,
carried on from document to document, so every chunk holds exactly ``T / 2cp`` tokens.

Attention stays exact with the zigzag masks unchanged: the attention core orders keys by the
zigzag chunk positions (`ContextParallelAttention.mask`), and the layout keeps the tokens of each
document in their order along those positions (piece k before piece k + 1, a piece in order), so
"key before query in the same document" is the same relation; cross-document pairs are masked by
the document ids, RoPE reads the sharded ``position_ids``.
"""

from __future__ import annotations

import torch

from strategies.core.document_runs import run_positions


def document_zigzag_order(document_ids_t: torch.Tensor, cp: int) -> torch.Tensor:
    """``[T]`` int64: the original index of the token at each slot of the zigzag chunks.

    Slot ``k * T/(2cp) + j`` is the j-th token of chunk k; rank r keeps chunks r and ``2cp-1-r``
    (`strategies.context.sharding.shard_positions` applied to this order).

    Args:
        document_ids_t: ``[T]`` document ids of one row; a document is a run of equal ids.
        cp: context-parallel degree; ``T`` must be a multiple of ``2 cp``.
    """
    seq_len, parts = document_ids_t.shape[0], 2 * cp
    starts = torch.ones(seq_len, dtype=torch.bool, device=document_ids_t.device)
    starts[1:] = document_ids_t[1:] != document_ids_t[:-1]
    lengths = torch.diff(torch.nonzero(starts).flatten(), append=torch.tensor([seq_len], device=starts.device)).cpu()
    base, extra = lengths // parts, lengths % parts
    offset = (torch.cumsum(extra, 0) - extra) % parts  # where each document's extra tokens start
    k = torch.arange(parts)
    sizes = base[:, None] + (((k[None, :] - offset[:, None]) % parts) < extra[:, None]).long()  # [docs, 2cp]
    chunk_t = torch.repeat_interleave(k.repeat(len(lengths)), sizes.flatten())
    key = chunk_t * seq_len + torch.arange(seq_len)
    return torch.argsort(key).to(document_ids_t.device)


def shard_documents(batch: dict[str, torch.Tensor], index: torch.Tensor, cp: int) -> dict[str, torch.Tensor]:
    """This rank's tokens of every ``[B, T]`` tensor of ``batch`` under document-aware sharding.

    Args:
        batch: rows with ``document_ids`` (``[B, T]``; rows without them shard as plain zigzag).
        index: ``[T / cp]`` zigzag slots of this rank (`strategies.context.sharding.shard_positions`).
        cp: context-parallel degree.
    """
    docs = batch["document_ids"]
    seq_len = docs.shape[1]
    order = torch.stack([document_zigzag_order(row, cp) for row in docs])[:, index]  # [B, T/cp]
    return {k: v.gather(1, order) if v.dim() == 2 and v.shape[1] == seq_len else v for k, v in batch.items()}


def rank_causal_work(document_ids_t: torch.Tensor, tokens: torch.Tensor) -> int:
    """Query-key pairs that the queries at original indices ``tokens`` attend in one row ``[T]``
    (block-diagonal causal: its index in its document, plus one, per query)."""
    return int(run_positions(document_ids_t)[tokens].sum())
