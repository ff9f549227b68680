"""A key/value cache for autoregressive decoding, as an attention core of `llama.Llama`.

The model swaps its attention computation through ``set_attention_core`` (context parallelism
does the same); `KVCache` keeps each layer's keys and values (after RoPE) from earlier forwards
and attends the new queries to all of them, so each generated token runs the model on that one
token instead of the whole context (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", section 2). Plain causal attention over one sequence: no packing, no padding.

Shape suffixes: B batch, T new tokens, S cached + new tokens, H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from trainer.models.attention import DOCUMENT_CAUSAL


class KVCache:
    """Per-layer keys and values of the tokens seen so far; the blocks call it in layer order.

    Use through `kv_cache` (it installs and removes the core). Each forward must give
    ``position_ids_bt`` = ``arange(length, length + T)``: the cache does not move RoPE positions.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._layer = 0

    @property
    def length(self) -> int:
        """Tokens cached (S of the last forward)."""
        return 0 if self.keys[-1] is None else self.keys[-1].shape[1]

    def mask(self, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """Once per forward (before the blocks): starts at layer 0; the new tokens' causal mask
        [1, 1, T, S] (query t, at position length + t, sees keys 0 .. length + t), None for one token.

        Raises:
            ValueError: with ``document_ids_bt`` (packed rows are not decoded with a cache).
        """
        if document_ids_bt is not None:
            raise ValueError("KVCache decodes one plain sequence; call the model without document_ids_bt")
        self._layer = 0
        if seq_len == 1:
            return None
        past = self.length
        keys_s = torch.arange(past + seq_len, device=device)
        return (keys_s[None, :] <= past + torch.arange(seq_len, device=device)[:, None])[None, None]

    def __call__(
        self, q_bthe: torch.Tensor, k_btke: torch.Tensor, v_btke: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Appends this layer's new keys/values and attends the new queries to all cached ones."""
        i = self._layer
        self._layer += 1
        if self.keys[i] is not None:
            k_btke = torch.cat([self.keys[i], k_btke], dim=1)
            v_btke = torch.cat([self.values[i], v_btke], dim=1)
        self.keys[i], self.values[i] = k_btke, v_btke
        if mask is None and q_bthe.shape[1] == 1:
            mask = torch.ones(
                1, 1, 1, k_btke.shape[1], dtype=torch.bool, device=q_bthe.device
            )  # the last token sees all
        return DOCUMENT_CAUSAL(q_bthe, k_btke, v_btke, mask)


@contextmanager
def kv_cache(model: nn.Module) -> Iterator[KVCache]:
    """Runs ``model`` (a `llama.Llama`) with a fresh `KVCache` as its attention core, then puts
    its own core back."""
    cache, previous = KVCache(len(model.layers)), model.attention_core
    model.set_attention_core(cache)
    try:
        yield cache
    finally:
        model.set_attention_core(previous)
