"""Case C19 (data side) — packed examples must not attend or predict across documents
(huggingface/trl#784).

Scenario: document A (3 tokens) and document B (5 tokens) packed into one row of 8 with
pack([(A, shift_labels(A)), (B, shift_labels(B))], seq_len=8).
Expected: position_ids = [0, 1, 2, 0, 1, 2, 3, 4]; document ids = [0, 0, 0, 1, 1, 1, 1, 1]; the label
at A's last position is -100, so there are exactly 6 supervised targets, not 7; the block-diagonal
causal mask built from the document ids never lets B see A.
"""

import torch

from trainer.data.packing import IGNORE_INDEX, pack, shift_labels

A = [11, 12, 13]
B = [21, 22, 23, 24, 25]


def test_positions_document_ids_and_labels():
    rows = pack([(A, shift_labels(A)), (B, shift_labels(B))], seq_len=8, pad_id=0)
    assert len(rows) == 1
    row = rows[0]
    assert row["input_ids"].tolist() == A + B
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert row["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert row["labels"].tolist() == [12, 13, IGNORE_INDEX, 22, 23, 24, 25, IGNORE_INDEX]
    assert row["labels"][len(A) - 1] == IGNORE_INDEX  # A's last token does not predict B's first
    assert rows.num_supervised_tokens() == 6


def test_block_diagonal_mask_from_document_ids():
    rows = pack([(A, shift_labels(A)), (B, shift_labels(B))], seq_len=8, pad_id=0)
    doc = rows.document_ids[0]
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    mask = causal & (doc[:, None] == doc[None, :])
    assert not mask[3:, :3].any()  # B never sees A
    assert mask[3:, 3:].equal(causal[:5, :5]) and mask[:3, :3].equal(causal[:3, :3])
    naive = causal  # what a plain causal mask over the packed row would allow
    assert naive[3:, :3].any()
