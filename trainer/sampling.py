"""Sampling one sequence from a decoder: the library under ``plait generate`` and ``plait chat``.

`sample` decodes one sequence (greedy or top-k at a temperature) with a KV cache
(`trainer.models.kv_cache`: the prompt runs once, then each new token alone), stopped at EOS or
when the context is full; `continue_text` is it on text. Many prompts at once (online RL rollouts,
exact match): `trainer.batch_sampling`. `sample` raises `NonFiniteLogitsError` on logits that
are not finite (diverged weights). See karpathy/nanochat ``nanochat/engine.py`` (a KV-cache engine beside the model,
called by the chat CLI, the web server and the evaluations alike).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from typing import Annotated

import torch
from torch import nn

from strategies.core.model_contract import declares
from strategies.core.ranges import NON_NEGATIVE, POSITIVE, range_problems
from trainer.data.tokenizer import Tokenizer
from trainer.models.kv_cache import kv_cache
from trainer.rl.rollout import before_stop


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
    stop_ids: Collection[int] = (),
    use_cache: bool = True,
    until: Callable[[list[int]], bool] | None = None,
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
        stop_ids: more tokens that end it as EOS does (a chat template's end of turn,
            `trainer.data.answer_end.turn_end_ids`; not returned).
        until: called with the generated ids after each new token; True ends it there (that token
            returned): a stop marker that is several tokens (`continue_text`'s ``stop_text``).

    Returns:
        The generated ids (without the prompt and the EOS or stop token).

    Raises:
        ValueError: an option is out of its declared range, or the prompt is empty (all named at once).
        NonFiniteLogitsError: see `_next_token`.
    """
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k}
    problems = range_problems(sample, options.items())
    if not prompt_ids:
        problems.append("the prompt needs at least one token (an empty text prompt: start it with EOS)")
    if problems:
        raise ValueError("sample: " + "; ".join(problems))
    ids = list(prompt_ids[-(max_seq_len - 1) :])
    stops = {eos_id, *stop_ids}
    out: list[int] = []
    with kv_cache(model) if use_cache else nullcontext() as cache:
        new = ids
        while len(out) < max_new_tokens and len(ids) < max_seq_len:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + len(new))[None]
            logits = model(torch.tensor([new]), position_ids_bt=positions)[0, -1].float()
            next_id = _next_token(logits, temperature=temperature, top_k=top_k)
            if next_id in stops:
                break
            out.append(next_id)
            ids.append(next_id)
            new = [next_id] if cache is not None else ids
            if until is not None and until(out):
                break
    return out


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
    stop_ids: Collection[int] = (),
    stop_text: Sequence[str] = (),
    use_cache: bool = True,
) -> str:
    """The model's continuation of ``text``, sampled as `sample` does (stopped at the tokenizer's
    EOS, at one of ``stop_ids`` or at ``model.max_seq_len``), decoded. An empty ``text`` starts
    from EOS alone.

    Args:
        stop_ids: more tokens that end it (a chat template's end of turn, `trainer.data.answer_end.turn_end_ids`).
        stop_text: strings that end it where the decoded continuation first holds one, cut off (a
            chat template's end-of-turn marker that the tokenizer spells in several tokens,
            `trainer.data.answer_end.turn_end_text`).
        use_cache: decode with a KV cache when the model takes one (`caches`).

    Raises:
        NonFiniteLogitsError: see `sample`.
    """
    # A stop string that the last token completes lies in the last tokens that spell its bytes (each
    # token at least one byte; a margin for those that decode to none): decoding them alone keeps the
    # test per token constant, not growing with the answer.
    tail = 4 * max((len(s.encode()) for s in stop_text), default=0) + 8
    new_ids = sample(
        model,
        tokenizer.encode(text) or [tokenizer.eos_id],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        max_seq_len=model.max_seq_len,
        eos_id=tokenizer.eos_id,
        stop_ids=stop_ids,
        use_cache=use_cache and caches(model),
        until=(lambda ids: any(s in tokenizer.decode(ids[-tail:]) for s in stop_text)) if stop_text else None,
    )
    return before_stop(tokenizer.decode(new_ids), stop_text)
