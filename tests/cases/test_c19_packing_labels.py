"""Case C19 — packed examples must not attend or predict across documents
(huggingface/trl#784).

Scenario: document A (3 tokens) and document B (5 tokens) packed into one row of 8 with
pack([(A, shift_labels(A)), (B, shift_labels(B))], seq_len=8).
Expected: position_ids = [0, 1, 2, 0, 1, 2, 3, 4]; document ids = [0, 0, 0, 1, 1, 1, 1, 1]; the label
at A's last position is -100, so there are exactly 6 supervised targets, not 7; the block-diagonal
causal attention plait runs over the document ids (its CPU kernel, the dense fallback and
FlexAttention's block mask) equals the test's own softmax under the written-out mask, so B never
sees A. With plait's model and objective, the packed loss equals (A's 2 + B's 4 target CEs) / 6,
the token-weighted mean of the documents run separately, and replacing A's tokens changes no
logit of B (max |delta| = 0).
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


# The mask of A (positions 0-2) then B (3-7), written out: query row t may attend key column s.
ALLOWED = torch.tensor(
    [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 1, 1],
    ],
    dtype=torch.bool,
)


def _attention_under(allowed_tt, q_bthe, k_bthe, v_bthe):  # noqa: ANN001, ANN202
    """The test's own attention: softmax(q k^T / sqrt(E)) over the allowed keys, times v."""
    scores_bhts = torch.einsum("bthe,bshe->bhts", q_bthe, k_bthe) / q_bthe.shape[-1] ** 0.5
    weights = scores_bhts.masked_fill(~allowed_tt, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhts,bshe->bthe", weights, v_bthe)


def test_plait_attention_over_the_packed_document_ids_is_block_diagonal():
    from trainer.models.attention import DOCUMENT_CAUSAL
    from trainer.models.document_masks import block_causal_mask, document_block_mask, flex_document_attention

    rows = pack([(A, shift_labels(A)), (B, shift_labels(B))], seq_len=8, pad_id=0)
    doc_bt = rows.document_ids  # [1, 8]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g) for _ in range(3))
    expected = _attention_under(ALLOWED, q, k, v)
    # The CPU kernel (causal SDPA per document), the dense fallback and FlexAttention's block mask.
    cpu = DOCUMENT_CAUSAL(q, k, v, DOCUMENT_CAUSAL.mask(doc_bt, 8, torch.device("cpu")))
    torch.testing.assert_close(cpu, expected, rtol=1e-6, atol=1e-6)
    assert block_causal_mask(doc_bt)[0, 0].equal(ALLOWED)
    dense = DOCUMENT_CAUSAL(q, k, v, block_causal_mask(doc_bt))
    torch.testing.assert_close(dense, expected, rtol=1e-6, atol=1e-6)
    flex = flex_document_attention(q, k, v, document_block_mask(doc_bt, compiled=False), compiled=False)
    torch.testing.assert_close(flex, expected, rtol=1e-6, atol=1e-6)
    # What a plain causal mask over the packed row gives instead: B's outputs mix in A's values.
    causal = _attention_under(torch.ones(8, 8, dtype=torch.bool).tril(), q, k, v)
    assert (causal[:, 3:] - expected[:, 3:]).abs().max() > 1e-3


# Model side: plait's Llama + CausalLM objective on the packed row.
def _model() -> "torch.nn.Module":
    from trainer.models.llama import Llama

    torch.manual_seed(0)
    return Llama(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8).eval()


def test_packed_loss_is_the_token_weighted_mean_of_the_separate_documents():
    from trainer.objectives.pretrain import CausalLM

    model, objective = _model(), CausalLM()
    rows = pack([(A, shift_labels(A)), (B, shift_labels(B))], seq_len=8, pad_id=0)
    packed = {k: v[None] for k, v in rows[0].items()}
    with torch.no_grad():
        packed_loss = objective.loss_sum(model, packed) / objective.num_tokens(packed)
        separate_sum, separate_count = 0.0, 0.0
        for doc in (A, B):
            batch = {"input_ids": torch.tensor([doc]), "labels": torch.tensor([shift_labels(doc)])}
            separate_sum += objective.loss_sum(model, batch)
            separate_count += objective.num_tokens(batch)
        naive = {"input_ids": packed["input_ids"], "labels": torch.tensor([shift_labels(A + B)])}
        naive_loss = objective.loss_sum(model, naive) / objective.num_tokens(naive)
    assert objective.num_tokens(packed) == 6 and objective.num_tokens(naive) == 7
    torch.testing.assert_close(packed_loss, separate_sum / separate_count, rtol=1e-6, atol=1e-6)
    assert abs(naive_loss - packed_loss) > 1e-3  # plain causal packing is a different (wrong) loss


def test_changing_document_a_changes_no_logit_of_b():
    model = _model()
    rows = pack([(A, shift_labels(A)), (B, shift_labels(B))], seq_len=8, pad_id=0)
    other = pack([([1, 2, 3], shift_labels([1, 2, 3])), (B, shift_labels(B))], seq_len=8, pad_id=0)
    with torch.no_grad():
        logits = [
            model(r.input_ids, position_ids_bt=r.position_ids, document_ids_bt=r.document_ids) for r in (rows, other)
        ]
        naive = [model(r.input_ids) for r in (rows, other)]
    assert (logits[0][:, 3:] - logits[1][:, 3:]).abs().max().item() == 0.0
    assert (naive[0][:, 3:] - naive[1][:, 3:]).abs().max().item() > 1e-3
