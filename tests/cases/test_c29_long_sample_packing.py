"""Case C29 — packing a sample longer than max_seq_len (pytorch/torchtune#1689).

Scenario: max_seq_len=60, with either packing policy (``split``: torchtune's
split_across_pack=True; ``whole``: samples that fit are never cut, longer ones continue):
  (a) one 121-token sample -> 3 packs holding 60, 60 and 1 token (+ 59 pad);
  (b) ten 30-token samples then one 61-token sample (361 tokens) -> 7 packs, 6 full and 1 with a
      single token.
Expected: no exception; the non-pad tokens of all packs, concatenated, equal the input stream;
every pack has length 60; each pack's per-document lengths (seq_lens) sum to its non-pad count.
Under ``data.long_samples=error`` (SFT) the 121-token sample raises a ValueError naming its length
(121) and the fixes.
"""

import pytest
import torch

from trainer.data.packing import IGNORE_INDEX, fit_long_samples, pack, shift_labels

SEQ_LEN = 60
PAD = 0


def _samples(lengths):
    samples, next_id = [], 1  # distinct ids, never PAD, so the stream order is checkable
    for n in lengths:
        ids = list(range(next_id, next_id + n))
        next_id += n
        samples.append((ids, shift_labels(ids)))
    return samples


def _check(rows, samples, expected_non_pad):
    assert len(rows) == len(expected_non_pad)
    assert all(len(rows[i]["input_ids"]) == SEQ_LEN for i in range(len(rows)))
    real = rows.input_ids != PAD
    assert real.sum(dim=1).tolist() == expected_non_pad
    stream = [t for ids, _ in samples for t in ids]
    assert rows.input_ids[real].tolist() == stream
    assert rows.labels[real].tolist() == [t for _, lab in samples for t in lab]
    assert (rows.labels[~real] == IGNORE_INDEX).all()
    for i, n in enumerate(expected_non_pad):
        seq_lens = torch.bincount(rows.document_ids[i][real[i]]).tolist()
        assert sum(seq_lens) == n and all(seq_lens)


@pytest.mark.parametrize("policy", ["split", "whole"])
def test_a_one_121_token_sample_gives_three_packs(policy):
    samples = _samples([121])
    rows = pack(samples, seq_len=SEQ_LEN, pad_id=PAD, policy=policy)
    _check(rows, samples, [60, 60, 1])
    # Each piece restarts its positions; the last pack is 1 token then a 59-token pad block.
    assert rows.position_ids[0].tolist() == list(range(60))
    assert rows.position_ids[2].tolist() == [0] + list(range(59))
    assert rows.document_ids[2].tolist() == [0] + [1] * 59
    # The label of a piece's last token is still the next token of the same sample.
    assert rows.labels[0, -1] == rows.input_ids[1, 0] == 61
    assert rows.labels[2, 0] == IGNORE_INDEX


@pytest.mark.parametrize("policy", ["split", "whole"])
def test_b_ten_short_then_one_long_sample_gives_seven_packs(policy):
    samples = _samples([30] * 10 + [61])
    assert sum(len(ids) for ids, _ in samples) == 361
    rows = pack(samples, seq_len=SEQ_LEN, pad_id=PAD, policy=policy)
    _check(rows, samples, [60] * 6 + [1])
    assert rows.document_ids[0].tolist() == [0] * 30 + [1] * 30
    assert rows.document_ids[5].tolist() == [0] * 60  # the first 60 tokens of the long sample
    assert rows.labels[5, -1] == rows.input_ids[6, 0]


def test_error_policy_rejects_the_long_sample_by_length():
    with pytest.raises(ValueError, match="121") as err:
        fit_long_samples(_samples([121]), seq_len=SEQ_LEN, policy="error")
    assert "data.long_samples=split" in str(err.value)
    kept, counts = fit_long_samples(_samples([30] * 10), seq_len=SEQ_LEN, policy="error")
    assert len(kept) == 10 and (counts.samples, counts.dropped, counts.truncated, counts.supervised_tokens_lost) == (
        10,
        0,
        0,
        0,
    )
    kept, counts = fit_long_samples(_samples([121, 30]), seq_len=SEQ_LEN, policy="truncate")
    assert [len(ids) for ids, _ in kept] == [60, 30] and (counts.truncated, counts.supervised_tokens_lost) == (1, 60)
    kept, counts = fit_long_samples(_samples([121, 30]), seq_len=SEQ_LEN, policy="drop")
    assert [len(ids) for ids, _ in kept] == [30] and (
        counts.dropped,
        counts.truncated,
        counts.supervised_tokens_lost,
    ) == (1, 0, 120)
