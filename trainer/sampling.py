"""Sampling from a decoder: the library under ``plait generate``, ``plait chat`` and the exact-match
evaluator (`trainer.evaluators.exact_match`).

`sample` decodes one sequence (greedy or top-k at a temperature) with a KV cache
(`trainer.models.kv_cache`: the prompt runs once, then each new token alone), stopped at EOS or
when the context is full; `greedy_batch` decodes many prompts at once without a cache (left
padding as a document of its own). `sample` raises `NonFiniteLogitsError` on logits that are
not finite (diverged weights). See karpathy/nanochat ``nanochat/engine.py`` (a KV-cache engine beside the model,
called by the chat CLI, the web server and the evaluations alike).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from strategies.core.model_contract import declares
from strategies.core.ranges import NON_NEGATIVE, POSITIVE
from trainer.data.tokenizer import Tokenizer
from trainer.models.kv_cache import kv_cache


class NonFiniteLogitsError(ValueError):
    """The model's logits (or logits / temperature) hold inf or NaN: nothing can be sampled."""


def _next_token(logits: torch.Tensor, *, temperature: float, top_k: int | None) -> int:
    """Greedy (temperature <= 0) or top-k sampling at ``temperature`` from one [V] row of logits.

    Raises:
        NonFiniteLogitsError: the logits are not finite (diverged weights whose activations
            overflow), or dividing them by ``temperature`` overflows.
    """
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogitsError(
            "the model's logits are not finite (inf or NaN): its weights have diverged; "
            "generate from an earlier checkpoint (ckpt=<run>/checkpoints/step_N)"
        )
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogitsError(
            f"temperature={temperature} makes the logits overflow; raise it, or use temperature=0 (greedy)"
        )
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1))


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: Annotated[int, POSITIVE],
    temperature: Annotated[float, NON_NEGATIVE],
    top_k: Annotated[int, POSITIVE] | None,
    max_seq_len: int,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Autoregressive sampling of one sequence, stopped at EOS or when the context is full.

    With ``use_cache`` (a `trainer.models.kv_cache.KVCache`) the prompt runs once and each new
    token runs alone; without it the whole context runs again for every token (same tokens:
    greedy decoding is equal token for token).

    Args:
        prompt_ids: token ids of the prompt (at least one); only its last ``max_seq_len - 1`` are kept.
        temperature: softmax temperature; 0 means greedy.
        top_k: sample among the k most likely tokens (None: all).
        max_seq_len: the model's context: generation stops when prompt + output fill it.
        eos_id: stop after this token (not returned); None: never.

    Returns:
        The generated ids (without the prompt and the EOS).

    Raises:
        NonFiniteLogitsError: see `_next_token`.
    """
    ids = list(prompt_ids[-(max_seq_len - 1) :])
    out: list[int] = []
    with kv_cache(model) if use_cache else nullcontext() as cache:
        new = ids
        while len(out) < max_new_tokens and len(ids) < max_seq_len:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + len(new))[None]
            logits = model(torch.tensor([new]), position_ids_bt=positions)[0, -1].float()
            next_id = _next_token(logits, temperature=temperature, top_k=top_k)
            if next_id == eos_id:
                break
            out.append(next_id)
            ids.append(next_id)
            new = [next_id] if cache is not None else ids
    return out


@torch.no_grad()
def greedy_batch(
    model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, eos_id: int, device: torch.device | str = "cpu"
) -> list[list[int]]:
    """Greedy continuations of many prompts at once (no KV cache), each stopped at its first EOS.

    Prompts are left-padded; the padding is a document of its own (``document_ids`` 0, the
    prompt 1) and positions start at 0 at each prompt, so every row computes exactly what it
    would alone.

    Args:
        prompts: token ids per prompt (each non-empty); prompt + ``max_new_tokens`` must fit the
            model's context.

    Returns:
        The generated ids per prompt, without the prompt and without the EOS.
    """
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    docs = torch.zeros_like(ids)
    pos = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        docs[i, width - len(p) :] = 1
        pos[i, width - len(p) :] = torch.arange(len(p))
        pos[i, : width - len(p)] = torch.arange(width - len(p))
    ids, docs, pos = ids.to(device), docs.to(device), pos.to(device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out = []
    for _ in range(max_new_tokens):
        logits = model(ids, position_ids_bt=pos, document_ids_bt=docs)[:, -1].float()
        if isinstance(logits, DTensor):  # tensor parallelism's vocabulary-sharded logits
            logits = logits.full_tensor()
        next_ids = logits.argmax(-1)
        out.append(torch.where(done, torch.full_like(next_ids, eos_id), next_ids))
        done |= next_ids == eos_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, next_ids[:, None]], 1)
        docs = torch.cat([docs, torch.ones_like(next_ids)[:, None]], 1)
        pos = torch.cat([pos, pos[:, -1:] + 1], 1)
    generated = torch.stack(out, 1).tolist() if out else [[] for _ in prompts]
    return [row[: row.index(eos_id)] if eos_id in row else row for row in generated]


def caches(model: nn.Module) -> bool:
    """Whether ``model`` takes a KV cache (`trainer.models.kv_cache.kv_cache`: it swaps the model's
    attention core); a model of one's own without ``set_attention_core`` generates without one."""
    return declares(model, "set_attention_core")


def continue_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    text: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    use_cache: bool = True,
) -> str:
    """The model's continuation of ``text``, sampled as `sample` does (stopped at the tokenizer's
    EOS or at ``model.max_seq_len``), decoded. An empty ``text`` starts from EOS alone.

    Args:
        use_cache: decode with a KV cache when the model takes one (`caches`).

    Raises:
        NonFiniteLogitsError: see `sample`.
    """
    new_ids = sample(
        model,
        tokenizer.encode(text) or [tokenizer.eos_id],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        max_seq_len=model.max_seq_len,
        eos_id=tokenizer.eos_id,
        use_cache=use_cache and caches(model),
    )
    return tokenizer.decode(new_ids)
