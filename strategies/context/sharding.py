"""A row's tokens over the cp ranks: which positions each rank keeps (zigzag, contiguous or
by document, `strategies.context.document_shards`), the batch cut to them, and the causal attention
work each rank then has.
"""

from __future__ import annotations

import torch

from strategies.context.document_shards import shard_documents


def shard_positions(seq_len: int, cp: int, rank: int, *, load_balance: bool = True) -> torch.Tensor:
    """Positions (``[seq_len / cp]`` int64) of the tokens that cp rank ``rank`` keeps, in memory order.

    With ``load_balance`` the sequence is cut into ``2 * cp`` chunks and rank r keeps chunks r and
    ``2cp - 1 - r``: every rank then has the same causal work. Without it, rank r keeps the r-th
    contiguous ``seq_len / cp`` tokens.

    Raises:
        ValueError: ``seq_len`` not divisible by ``2 * cp`` (``cp`` without ``load_balance``).
    """
    parts = 2 * cp if load_balance else cp
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} is not divisible by {parts} (context parallelism, cp={cp})")
    c = seq_len // parts
    if not load_balance:
        return torch.arange(rank * c, (rank + 1) * c)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def shard_batch(
    batch: dict[str, torch.Tensor], *, cp: int, rank: int, load_balance: bool = True, documents: bool = False
) -> dict[str, torch.Tensor]:
    """This cp rank's tokens of every ``[B, T]`` tensor in ``batch`` (input ids, labels, positions, documents).

    Labels are pre-shifted by the data pipeline, so sharding them with the inputs keeps each
    target with its position. Missing ``position_ids`` are filled with ``arange(T)`` first (the
    model would otherwise number the shard's tokens from 0). Other entries pass unchanged.
    With ``documents`` (and ``load_balance``) each document of a packed row is zigzagged on its
    own (`strategies.context.document_shards`; rows without ``document_ids`` shard as plain zigzag).
    """
    seq_len = batch["input_ids"].shape[1]
    if "position_ids" not in batch:
        batch = {
            **batch,
            "position_ids": torch.arange(seq_len, device=batch["input_ids"].device).expand_as(batch["input_ids"]),
        }
    index = shard_positions(seq_len, cp, rank, load_balance=load_balance).to(batch["input_ids"].device)
    if documents and load_balance and "document_ids" in batch:
        return shard_documents(batch, index, cp)
    return {k: v[:, index] if v.dim() >= 2 and v.shape[1] == seq_len else v for k, v in batch.items()}


def causal_work(document_ids_t: torch.Tensor, cp: int, *, load_balance: bool) -> list[int]:
    """Query-key pairs each cp rank's queries attend (block-diagonal causal) in one row ``[T]``.

    The attention FLOPs of a rank are proportional to its count; ``max / mean`` is the imbalance.
    """
    seq_len = document_ids_t.shape[0]
    pos = torch.arange(seq_len)
    work = []
    for rank in range(cp):
        q = shard_positions(seq_len, cp, rank, load_balance=load_balance)
        allowed = (pos[None, :] <= q[:, None]) & (document_ids_t[None, :] == document_ids_t[q][:, None])
        work.append(int(allowed.sum()))
    return work
