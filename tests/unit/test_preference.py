"""Preference losses against hand-computed values; response-only log-probs; pair formatting and truncation."""

import math

import pytest
import torch
from preference_pairs import FixedLogits, V, pair_batch

from trainer.data.encode import pair as encode_pair
from trainer.data.encode import pair_rows
from trainer.data.packing import IGNORE_INDEX
from trainer.objectives.pair_losses import dpo_loss, ipo_loss, orpo_loss, simpo_loss
from trainer.objectives.preference import DPO, SimPO

t = torch.tensor


def test_dpo_hand_computed():
    loss, rc, rr = dpo_loss(t([-2.0 + 2.5]), t([-3.0 + 2.8]), beta=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.07)), abs=1e-6)  # 0.658760
    assert loss.item() == pytest.approx(0.658760, abs=1e-6)
    assert (rc.item(), rr.item()) == pytest.approx((0.05, -0.02), abs=1e-7)


def test_ipo_hand_computed_per_token_average():
    # Chosen: 4 tokens at -1.0 (ref -1.5); rejected: 2 tokens at -2.0 (ref -1.8). h = 0.5 + 0.2 = 0.7.
    loss, _, _ = ipo_loss(t([4 * 0.5]), t([2 * -0.2]), t([4.0]), t([2.0]), beta=0.1)
    assert loss.item() == pytest.approx((0.7 - 5.0) ** 2, abs=1e-5)  # 18.49


def test_simpo_hand_computed():
    # avg log-probs -1 (4 tokens) and -3 (2 tokens); beta 2, gamma 1: -log sigmoid(-2 + 6 - 1).
    loss, rc, rr = simpo_loss(t([-4.0]), t([-6.0]), t([4.0]), t([2.0]), beta=2.0, gamma=1.0)
    assert loss.item() == pytest.approx(0.048587, abs=1e-6)
    assert (rc.item(), rr.item()) == (-2.0, -6.0)


def test_orpo_hand_computed():
    # log odds(a) = a - log(1 - e^a): -0.541325 and -2.948931; NLL term 1.0; lam 0.1.
    loss, _, _ = orpo_loss(t([-4.0]), t([-6.0]), t([4.0]), t([2.0]), lam=0.1)
    assert loss.item() == pytest.approx(1.0086206, abs=1e-6)


def test_changing_prompt_logits_leaves_pair_logps_unchanged():
    batch, logits, _ = pair_batch(-5.0, -2.0, -3.0)
    no_target = batch["labels"][0] == IGNORE_INDEX  # [2, T]: prompt and pad positions of each row
    changed = logits.clone()
    changed[no_target] = torch.randn(int(no_target.sum()), V) * 10
    objective = SimPO()
    before, _ = objective.sequence_logps_of(FixedLogits(logits), batch)
    after, _ = objective.sequence_logps_of(FixedLogits(changed), batch)
    assert torch.equal(before, after)
    # ... while changing a response position's logits does change them (the test can fail).
    changed[0, 2] += torch.randn(V)
    moved, _ = objective.sequence_logps_of(FixedLogits(changed), batch)
    assert not torch.equal(before[:, 0], moved[:, 0])


def test_metrics_sums_and_tie_counts_half():
    objective = DPO(beta=0.1)
    objective._accumulate(t([0.5, 0.0, -0.1]), t([0.1, 0.0, 0.2]), torch.ones(3, dtype=torch.bool))
    names, sums = objective.pop_sums()
    means = dict(zip(names, (sums[0] / sums[1]).tolist()))
    assert sums[1].tolist() == [3, 3, 3, 3]
    assert means["rewards/accuracy"] == pytest.approx(0.5)  # win, tie (1/2), loss
    assert means["rewards/margin"] == pytest.approx((0.4 + 0.0 - 0.3) / 3)
    assert objective.pop_sums()[1].sum().item() == 0  # popped


def test_pair_rows_truncation_keeps_the_response():
    prompt, chosen, rejected = list(range(100, 110)), list(range(200, 230)), [300] * 5
    rows, cut = pair_rows(prompt, chosen, rejected, seq_len=16, max_prompt_len=4, pad_id=1)
    assert cut == (6, 18, 0)  # prompt tokens cut at the start, chosen's cut at the end, rejected whole
    assert rows["input_ids"][0].tolist() == prompt[-4:] + chosen[:12]
    assert rows["input_ids"][1].tolist() == prompt[-4:] + rejected + [1] * 7
    assert [x for x in rows["labels"][0].tolist() if x != IGNORE_INDEX] == chosen[:12]
    assert [x for x in rows["labels"][1].tolist() if x != IGNORE_INDEX] == rejected
    # Short responses: the prompt keeps more than max_prompt_len, all that fits.
    rows, cut = pair_rows(prompt, [7, 8], [9], seq_len=16, max_prompt_len=4, pad_id=1)
    assert cut == (0, 0, 0) and rows["input_ids"][0, :12].tolist() == prompt + [7, 8]


def test_an_unpaired_row_is_cut_by_its_own_completion_not_the_kl_one():
    """KTO's second response is another prompt's completion, for the KL estimate: a row whose prompt
    and own completion fit kept its prompt whole only if the borrowed one fit too (a reviewer's
    rows: 12 of 32 prompts cut, reported as the user's, with a seq_len fix sized by the borrowed)."""
    prompt, own, borrowed = list(range(100, 112)), [7, 8], list(range(200, 230))
    rows, cut = pair_rows(prompt, own, borrowed, seq_len=16, max_prompt_len=4, pad_id=1, fit_first=True)
    assert cut == (0, 0, 26)  # the prompt whole, the own completion whole, the KL one cut to what is left
    assert rows["input_ids"][0].tolist() == [*prompt, 7, 8, 1, 1]
    assert rows["input_ids"][1].tolist() == prompt + borrowed[:4]
    assert pair_rows(prompt, own, borrowed, seq_len=16, max_prompt_len=4, pad_id=1)[1].prompt == 8  # paired: cut


def test_encode_pair_shares_the_prompt_and_supervises_only_the_final_answer():
    from test_chat import byte_tokenizer

    tok = byte_tokenizer()
    pair = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hey"},
            {"role": "user", "content": "2+2?"},
        ],
        "chosen": "4",
        "rejected": "5",
    }
    prompt, chosen, rejected = encode_pair(tok, pair)
    # The SFT format: the earlier assistant turn ends with EOS (context here, not a target).
    eos_at = prompt.index(tok.eos_id)
    assert tok.decode(prompt[:eos_at]) == "<|user|>\nHi\n<|assistant|>\nHey"
    assert tok.decode(prompt[eos_at + 1 :]) == "\n<|user|>\n2+2?\n<|assistant|>\n"
    assert tok.decode(chosen[:-1]) == "4" and tok.decode(rejected[:-1]) == "5"
    assert chosen[-1] == rejected[-1] == tok.eos_id
    rows, _ = pair_rows(prompt, chosen, rejected, seq_len=64, max_prompt_len=32, pad_id=tok.pad_id)
    targets = [[x for x in row if x != IGNORE_INDEX] for row in rows["labels"].tolist()]
    assert targets == [chosen, rejected]


def test_pair_rows_keeps_at_most_max_prompt_len_prompt_tokens_when_too_long():
    # README: the prompt keeps at most data.max_prompt_len tokens (it used to keep all that fit).
    prompt, chosen, rejected = list(range(100, 110)), list(range(200, 208)), [300] * 3
    rows, cut = pair_rows(prompt, chosen, rejected, seq_len=16, max_prompt_len=4, pad_id=1)
    assert cut == (6, 0, 0)
    assert rows["input_ids"][0, :12].tolist() == prompt[-4:] + chosen


def test_orpo_keeps_the_odds_ratio_gradient_of_confident_rows():
    # a = -1e-7 per token (a confident chosen row): d/dlogp_c of lam * -log sigmoid(log odds_c - log odds_r)
    # with log odds(a) = a - log(1 - e^a), d log odds / da = 1 / (1 - e^a). The old clamp at -1e-6 froze it.
    lam = 0.1
    logp_c = torch.tensor([-1e-7], dtype=torch.float64, requires_grad=True)
    loss, _, _ = orpo_loss(logp_c, torch.tensor([-3.0], dtype=torch.float64), torch.ones(1), torch.ones(1), lam=lam)
    loss.sum().backward()
    a_c, a_r = -1e-7, -3.0
    odds = lambda a: a - math.log(-math.expm1(a))  # noqa: E731
    z = odds(a_c) - odds(a_r)
    want = -1.0 + lam * -(1 - 1 / (1 + math.exp(-z))) / -math.expm1(a_c)
    assert logp_c.grad.item() == pytest.approx(want, rel=1e-6)


def test_orpo_row_without_targets_is_finite():
    loss, _, _ = orpo_loss(
        torch.zeros(2), torch.tensor([-3.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([2.0, 0.0]), lam=0.1
    )
    assert torch.isfinite(loss).all()
