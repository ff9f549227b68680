"""`sample_batch`: the batched, left-padded KV-cache sampler of RL rollouts decodes what the
uncached reference and one prompt at a time decode, per-row seeds make a row independent of its
batch, EOS is kept, ``all_done`` keeps data-parallel ranks stepping, and pad keys are never seen."""

from __future__ import annotations

import pytest
import torch

from trainer.batch_sampling import _filtered, greedy_batch, sample_batch
from trainer.models.kv_cache import KVCache, kv_cache
from trainer.models.llama import Llama
from trainer.sampling import NonFiniteLogitsError, sample

VOCAB, NEW = 50, 12
# Prompts of 1..9 tokens: up to 8 pad tokens in a batch.
PROMPTS = [[5], [17, 42, 3, 9, 21, 8, 30, 11, 2], [4, 4, 19], [33, 7, 1, 40, 12], [28, 6], [14, 45, 23, 36, 10, 31, 2]]
SEEDS = [101, 7, 2024, 55, 9, 31337]
SETTINGS = {
    "greedy": {"temperature": 0.0},
    "t1": {"temperature": 1.0},
    "t1_top_p_top_k": {"temperature": 1.0, "top_p": 0.9, "top_k": 5},
}


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64).eval()
    with torch.no_grad():  # larger weights than the init: a random model whose greedy path varies
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(std=0.2)
    return model


def _eos_some_rows_hit(free: list[list[int]]) -> int:
    """A token that ends some rows early (within their first NEW - 2) but not all of them."""
    early = [set(row[: NEW - 2]) for row in free]
    return next(t for t in range(VOCAB) if 0 < sum(t in row for row in early) < len(free))


@pytest.mark.parametrize("setting", SETTINGS)
def test_cached_uncached_batched_and_alone_decode_the_same_tokens(setting: str) -> None:
    model, kw = _model(), {"max_new_tokens": NEW, **SETTINGS[setting]}
    free = sample_batch(model, PROMPTS, eos_id=None, seeds=SEEDS, **kw)
    assert all(len(row) == NEW for row in free) and len({tuple(r) for r in free}) == len(PROMPTS)
    eos = _eos_some_rows_hit(free)
    # A row's draws are its own: with EOS it is its free run cut after the first EOS, kept.
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in free]
    assert any(len(row) < NEW for row in expected) and any(len(row) == NEW for row in expected)
    for use_cache in (True, False):
        batched = sample_batch(model, PROMPTS, eos_id=eos, seeds=SEEDS, use_cache=use_cache, **kw)
        assert batched == expected, use_cache
        alone = [
            sample_batch(model, [p], eos_id=eos, seeds=[s], use_cache=use_cache, **kw)[0]
            for p, s in zip(PROMPTS, SEEDS)
        ]
        assert alone == expected, use_cache
    reversed_rows = sample_batch(model, PROMPTS[::-1], eos_id=eos, seeds=SEEDS[::-1], **kw)
    assert reversed_rows[::-1] == expected


def test_the_seed_is_the_rows_randomness() -> None:
    model, kw = _model(), {"max_new_tokens": NEW, "eos_id": None, "temperature": 1.0}
    same = sample_batch(model, [PROMPTS[2]] * 3, seeds=[1, 1, 2], **kw)
    assert same[0] == same[1] != same[2]


def test_greedy_cached_batch_is_sample_with_the_eos_kept() -> None:
    model = _model()
    free = sample_batch(model, PROMPTS, max_new_tokens=NEW, eos_id=None, temperature=0.0)
    eos = _eos_some_rows_hit(free)
    batched = sample_batch(model, PROMPTS, max_new_tokens=NEW, eos_id=eos, temperature=0.0)
    for prompt, row in zip(PROMPTS, batched):
        alone = sample(model, prompt, max_new_tokens=NEW, temperature=0.0, top_k=None, max_seq_len=64, eos_id=eos)
        assert row == (alone + [eos] if len(alone) < NEW else alone)
    # greedy_batch (the exact-match evaluator's, uncached) leaves the EOS out.
    assert greedy_batch(model, PROMPTS, max_new_tokens=NEW, eos_id=eos) == [
        r[:-1] if r[-1] == eos else r for r in batched
    ]


def test_all_done_keeps_every_row_decoding_until_it_says_so() -> None:
    model = _model()
    prompt = PROMPTS[3]
    free = sample_batch(model, [prompt], max_new_tokens=NEW, eos_id=None, temperature=0.0)[0]
    k = next(i for i, t in enumerate(free) if i > 0 and t not in free[:i])
    eos, forwards = free[k], []
    model.register_forward_hook(lambda *_: forwards.append(1))
    kw = {"max_new_tokens": NEW, "eos_id": eos, "temperature": 0.0}
    alone = sample_batch(model, [prompt, prompt], **kw)
    assert alone == [free[: k + 1]] * 2 and len(forwards) == k + 1  # stops when its rows are done
    calls: list[bool] = []
    forwards.clear()
    # Another rank still decoding for 8 steps: this one runs 8 forwards, its rows keep their output.
    stepped = sample_batch(model, [prompt, prompt], all_done=lambda mine: calls.append(mine) or len(calls) == 8, **kw)
    assert stepped == alone
    assert calls == [False] * k + [True] * (8 - k) and len(forwards) == 8
    calls.clear()
    never = sample_batch(model, [prompt], all_done=lambda mine: calls.append(mine) and False, **kw)
    assert never == [free[: k + 1]] and len(calls) == NEW  # max_new_tokens bounds the loop


def _assert_mask_is_padded_causal(cache: KVCache, pad_b: torch.Tensor, *, past: int, num_new: int) -> None:
    """Query t of row b sees keys pad_b[b] .. past + t; a pad query sees itself alone, never nothing
    (SDPA's NaN for an empty row on some backends; torch 2.13's CPU kernels give 0 instead)."""
    mask = cache.mask(None, num_new, torch.device("cpu"))
    assert mask.shape == (len(pad_b), 1, num_new, past + num_new)
    for b, pad in enumerate(pad_b.tolist()):
        for t in range(num_new):
            q = past + t
            seen = [s for s in range(past + num_new) if pad <= s <= q] if q >= pad else [q]
            assert mask[b, 0, t].nonzero().flatten().tolist() == seen, (b, t)


def test_pad_keys_get_no_attention_and_positions_start_at_each_rows_first_token() -> None:
    model = _model()
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    pad_b = torch.tensor([8, 0, 7])
    logits = []
    for pad_id in (0, 49):
        ids_bt = torch.full((3, 9), pad_id)
        for i, p in enumerate(prompts):
            ids_bt[i, 9 - len(p) :] = torch.tensor(p)
        with torch.no_grad(), kv_cache(model, pad_b) as cache:
            # RoPE is relative: unshifted positions change the logits by rounding only, so check them.
            assert cache.position_ids(9).tolist() == [[0] * 8 + [0], list(range(9)), [0] * 7 + [0, 1]]
            _assert_mask_is_padded_causal(cache, pad_b, past=0, num_new=9)
            prefill = model(ids_bt, position_ids_bt=cache.position_ids(9))
            assert cache.position_ids(1).tolist() == [[1], [9], [2]]
            _assert_mask_is_padded_causal(cache, pad_b, past=9, num_new=1)
            step = model(torch.tensor([[3], [4], [5]]), position_ids_bt=cache.position_ids(1))
        assert torch.isfinite(prefill).all() and torch.isfinite(step).all(), "a pad query's NaN leaked"
        logits.append((prefill, step))
    (prefill, step), (other_prefill, other_step) = logits
    for i, p in enumerate(prompts):
        assert torch.equal(prefill[i, 9 - len(p) :], other_prefill[i, 9 - len(p) :])
    assert torch.equal(step, other_step)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            plain = model(torch.tensor([p + [3 + i]]))[0]
        torch.testing.assert_close(prefill[i, 9 - len(p) :], plain[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[i], plain[-1:], atol=1e-5, rtol=1e-5)


def test_nucleus_keeps_the_fewest_tokens_holding_top_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = [(_filtered(logits, top_k=None, top_p=p) > float("-inf")).sum().item() for p in (0.4, 0.75, 0.85, 1.0)]
    assert kept == [1, 2, 3, 4]
    assert (_filtered(logits, top_k=2, top_p=1.0) > float("-inf")).tolist() == [[True, True, False, False]]


def test_bad_requests_name_the_fix() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"max_new_tokens <= 55 or shorter prompts") as raised:
        sample_batch(model, PROMPTS, max_new_tokens=60, eos_id=None, seeds=[1], top_p=0.0)
    assert "seeds has 1 entries for 6 prompts" in str(raised.value) and "top_p=0.0 must be in (0, 1]" in str(
        raised.value
    )
    with torch.no_grad():
        model.output.weight.fill_(3e38)
    for temperature in (0.0, 1.0):
        with pytest.raises(NonFiniteLogitsError, match="earlier checkpoint"):
            sample_batch(model, PROMPTS, max_new_tokens=4, eos_id=None, temperature=temperature, seeds=SEEDS)
