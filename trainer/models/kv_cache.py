"""A key/value cache for autoregressive decoding, as an attention core of `llama.Llama`.

The model swaps its attention computation through ``set_attention_core`` (context parallelism
does the same); `KVCache` keeps each layer's keys and values (after RoPE) from earlier forwards
and attends the new queries to all of them, so each generated token runs the model on that one
token instead of the whole context (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", section 2). Causal attention over one sequence, or over a batch of left-padded rows
(``pad_b``: row b's first ``pad_b[b]`` tokens are padding that no query attends); no packing. The
model's windowed layers (Gemma 3) attend within their sliding window of cached tokens.

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
    ``position_ids_bt`` = `position_ids` (``arange(length, length + T)`` without padding): the
    cache does not move RoPE positions.

    Args:
        num_layers: the model's blocks.
        pad_b: ``[B]`` (int) leading pad tokens of each left-padded row; None: one plain sequence
            (any B, no padding). Every forward then feeds all B rows, the same T new tokens each.
        window: the sliding window of ``window_layers`` (cache slots, as transformers counts it:
            query t sees the keys ``t - window < s <= t``); None: none.
        window_layers: the layers (their order among the model's blocks) that attend within it.
    """

    def __init__(
        self,
        num_layers: int,
        pad_b: torch.Tensor | None = None,
        *,
        window: int | None = None,
        window_layers: tuple[int, ...] = (),
    ) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.pad_b = pad_b
        self.window, self.window_layers = window, window_layers
        self._layer = 0

    @property
    def length(self) -> int:
        """Tokens cached (S of the last forward)."""
        return 0 if self.keys[-1] is None else self.keys[-1].shape[1]

    def position_ids(self, num_new: int) -> torch.Tensor:
        """RoPE positions of the next ``num_new`` tokens: ``[1, T]`` = ``arange(length, length + T)``;
        with ``pad_b`` ``[B, T]``, shifted so each row's first real token is at 0 (pad tokens at 0),
        so a row computes what it computes alone."""
        device = None if self.pad_b is None else self.pad_b.device
        cached_t = torch.arange(self.length, self.length + num_new, device=device)[None]
        return cached_t if self.pad_b is None else (cached_t - self.pad_b[:, None]).clamp_min(0)

    def mask(self, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """Once per forward (before the blocks): starts at layer 0; the new tokens' causal mask
        [1, 1, T, S] (query t, at position length + t, sees keys 0 .. length + t), None for one token.

        With ``pad_b`` the mask is ``[B, 1, T, S]``: query t of row b sees key s iff
        ``pad_b[b] <= s <= length + t``, and a pad query sees itself alone: a query that sees nothing
        gets NaN from some SDPA backends (torch 2.13's CPU kernels give 0), which the next layer's
        pad keys would carry into real rows (0 weight x NaN value); a pad query's own output is unused.

        Raises:
            ValueError: with ``document_ids_bt`` (packed rows are not decoded with a cache).
        """
        if document_ids_bt is not None:
            raise ValueError("KVCache decodes plain or left-padded rows; call the model without document_ids_bt")
        self._layer = 0
        if seq_len == 1 and self.pad_b is None:
            return None
        past = self.length
        keys_s = torch.arange(past + seq_len, device=device)
        queries_t = past + torch.arange(seq_len, device=device)
        causal_ts = keys_s[None, :] <= queries_t[:, None]
        if self.pad_b is None:
            return causal_ts[None, None]
        real_bs = keys_s[None, :] >= self.pad_b.to(device)[:, None]
        itself_ts = keys_s[None, :] == queries_t[:, None]
        return ((real_bs[:, None, :] & causal_ts[None]) | itself_ts[None])[:, None]

    def __call__(
        self,
        q_bthe: torch.Tensor,
        k_btke: torch.Tensor,
        v_btke: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        sinks_h: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Appends this layer's new keys/values and attends the new queries to all cached ones
        (with GPT-OSS's attention sinks ``sinks_h``, see `attention.sink_attention`)."""
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
        if i in self.window_layers:
            S, T = k_btke.shape[1], q_bthe.shape[1]
            slots_s = torch.arange(S, device=q_bthe.device)
            near_ts = (slots_s[S - T :, None] - slots_s[None, :]) < self.window
            mask = mask & near_ts  # a pad query's own slot (distance 0) stays visible
        return DOCUMENT_CAUSAL(q_bthe, k_btke, v_btke, mask, sinks_h=sinks_h)


@contextmanager
def kv_cache(model: nn.Module, pad_b: torch.Tensor | None = None) -> Iterator[KVCache]:
    """Runs ``model`` (a `llama.Llama`) with a fresh `KVCache` as its attention core, then puts
    its own core back; ``pad_b``: see `KVCache`."""
    windowed = tuple(sorted(model.window_layers))
    cache = KVCache(len(model.layers), pad_b, window=model.sliding_window, window_layers=windowed)
    previous = model.attention_core
    model.set_attention_core(cache)
    try:
        yield cache
    finally:
        model.set_attention_core(previous)
