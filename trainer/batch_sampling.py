"""Sampling many prompts at once from a decoder: online RL rollouts (GRPO, ReST), the exact-match
evaluator and lm-eval's generations.

`sample_batch` samples left-padded prompts together with the KV cache (per-row seeds, top-k/top-p,
EOS kept, data-parallel stepping); `greedy_batch` is its greedy loop without a cache. Both raise
`trainer.sampling.NonFiniteLogitsError` on logits that are not finite (diverged weights). One
sequence: `trainer.sampling.sample`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from typing import Annotated, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from strategies.core.ranges import NON_NEGATIVE, POSITIVE, Range, range_problems
from trainer.models.kv_cache import kv_cache
from trainer.sampling import NonFiniteLogitsError, caches

# The token id fed at left padding and after a row's EOS: masked out, so any id would do.
PAD_ID = 0
TOP_P = Range(min=0, max=1, min_open=True)


def _left_padded(prompts: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts right-aligned in one ``[B, W]`` batch (W the longest) and ``pad_b`` ``[B]``,
    each row's leading pad tokens."""
    width = max(len(p) for p in prompts)
    ids_bt = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids_bt[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
    pad_b = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return ids_bt.to(device), pad_b.to(device)


def _filtered(logits_bv: torch.Tensor, *, top_k: int | None, top_p: float) -> torch.Tensor:
    """``logits_bv`` ``[B, V]`` with -inf outside each row's k most likely tokens and outside its
    nucleus: the fewest most likely tokens whose probability sums to ``top_p`` or more (Holtzman
    et al. 2020, "The Curious Case of Neural Text Degeneration"; ties at the edge by sort order)."""
    if top_k is not None and top_k < logits_bv.shape[-1]:
        kth_b1 = torch.topk(logits_bv, top_k, dim=-1).values[:, -1:]
        logits_bv = logits_bv.masked_fill(logits_bv < kth_b1, float("-inf"))
    if top_p < 1:
        sorted_bv, order_bv = torch.sort(logits_bv, dim=-1, descending=True)
        probs_bv = torch.softmax(sorted_bv, dim=-1)
        # A token stays when the tokens ranked above it hold less than top_p: the first always does.
        drop_bv = torch.cumsum(probs_bv, dim=-1) - probs_bv >= top_p
        logits_bv = logits_bv.masked_fill(drop_bv.scatter(-1, order_bv, drop_bv), float("-inf"))
    return logits_bv


def _next_tokens(
    logits_bv: torch.Tensor,
    active_b: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float,
    generators: list[torch.Generator] | None,
    check_finite: bool = True,
) -> torch.Tensor:
    """``[B]`` next ids of the rows ``active_b`` (finished rows get `PAD_ID`): greedy at temperature
    0, else one draw per row from the filtered softmax, with the row's own generator.

    Raises:
        NonFiniteLogitsError: an active row's logits (or logits / temperature) are not finite.
    """
    if check_finite and not bool(torch.isfinite(logits_bv[active_b]).all()):
        raise NonFiniteLogitsError(
            "the model's logits are not finite (inf or NaN): its weights have diverged; "
            "sample from an earlier checkpoint (ckpt=<run>/checkpoints/step_N)"
        )
    if temperature == 0:
        return torch.where(active_b, logits_bv.argmax(-1), PAD_ID)
    logits_bv = logits_bv / temperature
    if not bool(torch.isfinite(logits_bv[active_b]).all()):
        raise NonFiniteLogitsError(
            f"temperature={temperature} makes the logits overflow; raise it, or use temperature=0 (greedy)"
        )
    # Finished rows may hold anything (their tokens are ignored): uniform, so the draw is valid.
    logits_bv = torch.where(active_b[:, None], logits_bv, 0.0)
    probs_bv = torch.softmax(_filtered(logits_bv, top_k=top_k, top_p=top_p), dim=-1)
    if generators is None:
        drawn_b = torch.multinomial(probs_bv, 1)[:, 0]
    else:
        drawn_b = torch.cat([torch.multinomial(p_v, 1, generator=g) for p_v, g in zip(probs_bv, generators)])
    return torch.where(active_b, drawn_b, PAD_ID)


def _decode(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int],
    use_cache: bool,
    device: torch.device | str,
    all_done: Callable[[bool], bool] | None,
    **pick: Any,
) -> list[list[int]]:
    """The decoding loop of `sample_batch` (arguments there; ``pick`` goes to `_next_tokens`):
    per prompt its new ids up to and including the first of ``stop_ids`` (EOS and any other)."""
    ids_bt, pad_b = _left_padded(prompts, device)
    num_rows = len(prompts)
    done_b = torch.zeros(num_rows, dtype=torch.bool, device=ids_bt.device)
    stops_s = torch.tensor(sorted(stop_ids), dtype=torch.long, device=ids_bt.device)
    steps: list[torch.Tensor] = []
    with kv_cache(model, pad_b) if use_cache else nullcontext() as cache:
        new_bt = ids_bt
        for step in range(max_new_tokens):
            if cache is not None:
                logits_btv = model(new_bt, position_ids_bt=cache.position_ids(new_bt.shape[1]))
            else:
                # The padding as a document of its own (its positions count from 0 too): the
                # model's own document-causal kernels, independent of the cache's mask.
                keys_bs = torch.arange(ids_bt.shape[1], device=ids_bt.device).expand(num_rows, -1)
                real_bs = keys_bs >= pad_b[:, None]
                positions_bs = torch.where(real_bs, keys_bs - pad_b[:, None], keys_bs)
                logits_btv = model(ids_bt, position_ids_bt=positions_bs, document_ids_bt=real_bs.long())
            logits_bv = logits_btv[:, -1].float()
            if isinstance(logits_bv, DTensor):  # tensor parallelism's vocabulary-sharded logits
                logits_bv = logits_bv.full_tensor()
            next_b = _next_tokens(logits_bv, ~done_b, **pick)
            steps.append(next_b)
            done_b |= torch.isin(next_b, stops_s)
            finished = step == max_new_tokens - 1 or bool(done_b.all())
            if all_done(finished) if all_done is not None else finished:
                break
            new_bt = next_b[:, None]
            ids_bt = torch.cat([ids_bt, new_bt], dim=1)
    rows = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in prompts]
    return [row[: _first_stop(row, stop_ids) + 1] for row in rows]


def _first_stop(row: list[int], stop_ids: Collection[int]) -> int:
    """The index of ``row``'s first stop token; its last index without one."""
    return next((i for i, token in enumerate(row) if token in stop_ids), len(row) - 1)


def _stops(eos_id: int | None, stop_ids: Collection[int]) -> frozenset[int]:
    """EOS (when not None) and ``stop_ids``: the tokens a row ends at."""
    return frozenset(stop_ids) | ({eos_id} if eos_id is not None else frozenset())


@torch.no_grad()
def sample_batch(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: Annotated[int, POSITIVE],
    eos_id: int | None,
    stop_ids: Collection[int] = (),
    temperature: Annotated[float, NON_NEGATIVE] = 1.0,
    top_p: Annotated[float, TOP_P] = 1.0,
    top_k: Annotated[int, POSITIVE] | None = None,
    seeds: Sequence[int] | None = None,
    use_cache: bool = True,
    device: torch.device | str = "cpu",
    all_done: Callable[[bool], bool] | None = None,
) -> list[list[int]]:
    """Sampled continuations of many prompts at once (online RL rollouts), each stopped after its
    first EOS, with a KV cache over the left-padded batch.

    Each row computes what it would alone: the padding is masked (`trainer.models.kv_cache.KVCache`
    with ``pad_b``; without the cache, a document of its own) and its RoPE positions start at 0 at
    its first real token. Row i draws from its own ``torch.Generator`` seeded with ``seeds[i]``, so
    its tokens do not depend on the other prompts of the batch, their order, or ``use_cache``
    (up to float rounding of batched kernels, which can flip a near tie; draws differ by device).

    Args:
        model: a `trainer.models.llama.Llama` (``use_cache=False``: any model taking
            ``position_ids_bt`` and ``document_ids_bt``) with ``max_seq_len``.
        prompts: token ids per prompt, each non-empty.
        max_new_tokens: most tokens generated per prompt (EOS included); the longest prompt plus
            this must fit ``model.max_seq_len``.
        eos_id: a row stops after this token; None: every row runs ``max_new_tokens`` (unless
            ``stop_ids``).
        stop_ids: more tokens a row stops after, as after EOS (a chat template's end of turn,
            `trainer.data.answer_end.turn_end_ids`; vLLM's ``stop_token_ids``).
        temperature: softmax temperature; 0 means greedy (``top_p``, ``top_k`` and ``seeds`` unused).
        top_p: nucleus sampling: the fewest most likely tokens holding this probability (1: all).
        top_k: sample among the k most likely tokens (None: all); applied before ``top_p``.
        seeds: one per prompt; None: all rows draw from torch's global RNG (then a row's tokens
            depend on the batch).
        use_cache: decode with the KV cache (the prompt runs once, then one token per row); False
            runs the whole context at every step (the reference path, same tokens).
        device: where the ids (and the generators) live: the model's device.
        all_done: called once per decode step with whether every row here has finished; the loop
            goes on until it returns True (or ``max_new_tokens`` steps), finished rows decoding
            padding. Data-parallel ranks whose forwards are collective (FSDP gathers each block's
            weights) pass an all-reduce of it, e.g. ``lambda mine: all_reduce(int(mine), MIN) == 1``,
            and the same ``max_new_tokens``, so all run the same number of forwards. None: stop
            when every row here has finished.

    Returns:
        Per prompt its generated ids, without the prompt and WITH the EOS or stop token that
        stopped it (the policy is trained on it), at most ``max_new_tokens``. `sample` and
        `greedy_batch` leave it out.

    Raises:
        ValueError: an option is out of range, a prompt is empty, ``seeds`` does not have one seed
            per prompt, the longest prompt plus ``max_new_tokens`` exceeds ``model.max_seq_len``,
            or ``use_cache`` with a model that takes no KV cache (`caches`); all named at once.
        NonFiniteLogitsError: an unfinished row's logits are not finite (see `_next_tokens`).
    """
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    problems = range_problems(sample_batch, options.items())
    if not prompts or not all(prompts):
        problems.append("every prompt needs at least one token (an empty chat prompt: start it with EOS)")
    if seeds is not None and len(seeds) != len(prompts):
        problems.append(f"seeds has {len(seeds)} entries for {len(prompts)} prompts: give one seed per prompt")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > model.max_seq_len:
        problems.append(
            f"the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} exceeds the model's "
            f"max_seq_len={model.max_seq_len}; use max_new_tokens <= {model.max_seq_len - longest} or shorter prompts"
        )
    if use_cache and not caches(model):
        problems.append(f"{type(model).__name__} takes no KV cache (no set_attention_core); pass use_cache=False")
    if problems:
        raise ValueError("sample_batch: " + "; ".join(problems))
    generators = None
    if seeds is not None and temperature > 0:
        generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]
    return _decode(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        stop_ids=_stops(eos_id, stop_ids),
        use_cache=use_cache,
        device=device,
        all_done=all_done,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generators=generators,
    )


@torch.no_grad()
def greedy_batch(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    stop_ids: Collection[int] = (),
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """Greedy continuations of many prompts at once (no KV cache), each stopped at its first EOS
    or other stop token (``stop_ids``, as `sample_batch`).

    `sample_batch`'s loop at temperature 0 without the cache: the prompts are left-padded, the
    padding a document of its own (``document_ids`` 0, the prompt 1), positions start at 0 at
    each prompt, so every row computes exactly what it would alone. Unlike `sample_batch` it
    takes any model (no ``max_seq_len`` check) and does not check that the logits are finite
    (a diverged model scores what its argmax says).

    Args:
        prompts: token ids per prompt (each non-empty); prompt + ``max_new_tokens`` must fit the
            model's context.

    Returns:
        The generated ids per prompt, without the prompt and without the EOS or stop token.
    """
    stops = _stops(eos_id, stop_ids)
    rows = _decode(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        stop_ids=stops,
        use_cache=False,
        device=device,
        all_done=None,
        temperature=0.0,
        top_k=None,
        top_p=1.0,
        generators=None,
        check_finite=False,
    )
    return [row[:-1] if row and row[-1] in stops else row for row in rows]
