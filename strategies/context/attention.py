"""The context-parallel attention core: each attention module's core replaced by one that attends over
the whole sequence from this rank's ``T/cp`` tokens (ring, Ulysses or hybrid, `strategies.context.plugin`
picks the mode), knowing every token's global position and document id, so packed rows stay
block-diagonal causal when a document straddles shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from strategies.context.attention_blocks import block_kernels
from strategies.context.layout import CPLayout
from strategies.context.placement import OnGroup, WholeRows
from strategies.context.ring import RingMasks, ring_attention
from strategies.context.sharding import shard_positions
from strategies.context.ulysses import heads_to_seq, seq_to_heads
from strategies.core.model_contract import declares


class ContextParallelAttention:
    """The attention core of every `Attention` module under context parallelism.

    ``mask`` runs once per model forward and gathers the document ids of the whole row over the
    cp group; ``__call__`` runs in each layer: Ulysses all-to-all (if any), ring attention over
    the head groups, all-to-all back.

    Args:
        layout: this rank's groups (`build_cp_layout`).
        load_balance: the sharding `shard_batch` used (zigzag or contiguous).
        kv_chunk: keys per score block in `ring_attention` (0: whole blocks).
        kernel: the block kernels (`strategies.context.attention_blocks.block_kernels`): ``auto`` (fused
            on CUDA, eager fp32 on CPU), ``fused`` or ``eager``.
        whole: the model's one-process core (whole rows); sub_layouts: this rank's cp sub-groups
            by size (`strategies.context.layout.build_sub_layouts`), both for hybrid placement.
    """

    def __init__(
        self,
        layout: CPLayout,
        *,
        load_balance: bool = True,
        kv_chunk: int = 0,
        kernel: str = "auto",
        whole: Any = None,
        sub_layouts: dict[int, CPLayout] | None = None,
    ) -> None:
        block_kernels(torch.device("cpu"), kernel)  # fails on an unknown kernel name
        self.layout, self.load_balance, self.kv_chunk, self.kernel = layout, load_balance, kv_chunk, kernel
        self.whole, self.sub_layouts = whole, dict(sub_layouts or {})  # the one-process core; cp sub-groups
        self.group_size = layout.cp  # ranks the rows of the current forward are split over

    @property
    def row_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold the rest of the current forward's rows (the cp group, or the sub-group
        `training_group` chose); None while rows are whole on this rank. Per-row statistics beyond
        attention read it (the MoE's sequence-wise balance loss, `trainer.models.moe_router.balance_loss_sum`)."""
        if self.group_size == 1:
            return None
        return (self.layout if self.group_size == self.layout.cp else self.sub_layouts[self.group_size]).cp_group

    @contextmanager
    def training_group(self, size: int) -> Iterator[None]:
        """While active, forwards attend over the rows of a cp group of ``size`` ranks
        (`strategies.context.placement`): 1 with the one-process core (whole rows), a sub-group size
        with its layout (``sub_layouts``), the cp degree as usual. The masks made then carry the
        choice, so a recompute under activation checkpointing attends the same way.

        Raises:
            ValueError: no layout of that size (no one-process core for 1, or no such sub-group).
        """
        if size != self.layout.cp and not (size == 1 and self.whole is not None) and size not in self.sub_layouts:
            raise ValueError(
                f"no cp group of {size} ranks (built: 1, {', '.join(map(str, sorted(self.sub_layouts)))}, {self.layout.cp})"
            )
        self.group_size = size
        try:
            yield
        finally:
            self.group_size = self.layout.cp

    def mask(self, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device) -> RingMasks:
        """Positions and document ids of the queries and keys each layer's ring step sees.

        Args:
            document_ids_bt: this rank's ``[B, T/cp]`` document ids, or None (plain causal rows).
            seq_len: this rank's token count ``T/cp``.
            device: the device of the activations.
        """
        if self.group_size == 1:
            return WholeRows(self.whole.mask(document_ids_bt, seq_len, device))
        if self.group_size != self.layout.cp:
            lay = self.sub_layouts[self.group_size]
            return OnGroup(lay, self._ring_masks(lay, document_ids_bt, seq_len, device))
        return self._ring_masks(self.layout, document_ids_bt, seq_len, device)

    def _ring_masks(
        self, lay: CPLayout, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> RingMasks:
        pos = [shard_positions(seq_len * lay.cp, lay.cp, c, load_balance=self.load_balance) for c in range(lay.cp)]
        docs = None
        if document_ids_bt is not None:
            docs = [torch.empty_like(document_ids_bt) for _ in range(lay.cp)]
            dist.all_gather(docs, document_ids_bt.contiguous(), group=lay.cp_group)
        u = lay.ulysses_degree
        # A head group holds the tokens of its u ranks, concatenated in rank order (seq_to_heads).
        group_pos = tuple(torch.cat(pos[i : i + u]) for i in range(0, lay.cp, u))
        group_docs = None if docs is None else tuple(torch.cat(docs[i : i + u], dim=1) for i in range(0, lay.cp, u))
        me = lay.index // u
        on_host = torch.device(device).type == "cpu"
        return RingMasks(
            group_pos[me].to(device),
            None if group_docs is None else group_docs[me],
            tuple(p.to(device) for p in group_pos),
            group_docs,
            pos_kv_host=None if on_host else group_pos,
            last_query=int(group_pos[me].max()),
        )

    def __call__(
        self, q_bthe: torch.Tensor, k_btke: torch.Tensor, v_btke: torch.Tensor, masks: RingMasks
    ) -> torch.Tensor:
        """``[B, T/cp, H, E]`` queries and ``[B, T/cp, K, E]`` keys/values (after RoPE) -> ``[B, T/cp, H, E]``."""
        if isinstance(masks, WholeRows):
            return self.whole(q_bthe, k_btke, v_btke, masks.mask)
        lay = self.layout
        if isinstance(masks, OnGroup):
            lay, masks = masks.layout, masks.masks
        u = lay.ulysses_degree
        if u > 1:
            H, K = q_bthe.shape[2], k_btke.shape[2]
            if H % u or K % u:
                raise ValueError(f"Ulysses degree {u} must divide the local query heads {H} and kv heads {K}")
            q_bthe, k_btke, v_btke = (seq_to_heads(t, lay.ulysses_group, u) for t in (q_bthe, k_btke, v_btke))
        B, T, H, E = q_bthe.shape
        K = k_btke.shape[2]
        q_bkrqe = q_bthe.view(B, T, K, H // K, E).permute(0, 2, 3, 1, 4)
        out = ring_attention(
            q_bkrqe,
            k_btke.transpose(1, 2),
            v_btke.transpose(1, 2),
            ring=lay.ring,
            masks=masks,
            kv_chunk=self.kv_chunk,
            blocks=block_kernels(q_bthe.device, self.kernel),
        )
        out_bthe = out.permute(0, 3, 1, 2, 4).reshape(B, T, H, E)
        return heads_to_seq(out_bthe, lay.ulysses_group, u) if u > 1 else out_bthe


def apply_context_parallel(
    model: nn.Module,
    *,
    layout: CPLayout,
    load_balance: bool = True,
    kv_chunk: int = 0,
    kernel: str = "auto",
    sub_layouts: dict[int, CPLayout] | None = None,
) -> None:
    """Makes every attention module of ``model`` context-parallel, in place.

    ``model`` must offer ``set_attention_core`` (`trainer.models.llama.Llama`); a model without
    attention (a per-token test model) is left unchanged: per-token layers need no change under CP.
    """
    if declares(model, "set_attention_core"):
        core = ContextParallelAttention(
            layout,
            load_balance=load_balance,
            kv_chunk=kv_chunk,
            kernel=kernel,
            whole=model.attention_core,
            sub_layouts=sub_layouts,
        )
        model.set_attention_core(core)
