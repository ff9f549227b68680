"""Where each token sits in its document, for rows whose documents are runs of equal ids.

Packed rows (plait's packing, preference pairs, generation prompts) hold each document as one run
of equal document ids. The work estimates of data balancing, cp sharding and hybrid cp placement
all count, per token, its 1-based position in its run: the keys it attends under a
document-causal mask.
"""

from __future__ import annotations

import torch


def run_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` int64: each token's 1-based position in its run of equal ids along the last dim
    (the number of keys it attends under a document-causal mask), for ``[..., T]`` ids."""
    seq_len = document_ids.shape[-1]
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first + 1


def causal_pairs(document_ids: torch.Tensor) -> torch.Tensor:
    """``[...]`` int64: query-key pairs of each row of ``[..., T]`` ids under a document-causal mask."""
    return run_positions(document_ids).sum(dim=-1)


def longest_document(document_ids: torch.Tensor) -> torch.Tensor:
    """``[...]`` int64: the longest run of equal ids in each row of ``[..., T]`` ids."""
    return run_positions(document_ids).amax(dim=-1)
