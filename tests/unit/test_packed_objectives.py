"""The token objectives on packed rows: a row holding two documents scores each as if it were
alone (its own positions, no attention across the boundary), against an independent loss of the
documents run one per row (a reviewer's mutation dropped ``document_ids`` from SFT's forward: the
unit tests stayed green and only the learning tier's SFT entry saw it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.models.llama import Llama
from trainer.objectives.pretrain import CausalLM
from trainer.objectives.sft import SFT

V = 97


def _docs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two documents (ids, pre-shifted labels with -100 on the unsupervised prompt)."""
    g = torch.Generator().manual_seed(0)
    docs = []
    for length, prompt in ((11, 4), (9, 3)):
        ids = torch.randint(1, V, (length,), generator=g)
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        labels[: prompt - 1] = -100
        docs.append((ids, labels))
    return docs


def _reference(model: Llama, docs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Each document in a row of its own, its summed target negative log-likelihood."""
    total = torch.zeros(())
    for ids, labels in docs:
        logits = model(ids[None])[0]
        keep = labels != -100
        total = total + F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")
    return total


@pytest.mark.parametrize("objective", [CausalLM(), SFT(groups=["a"])], ids=["pretrain", "sft"])
def test_a_packed_row_scores_each_document_alone(objective) -> None:
    torch.manual_seed(0)
    model = Llama(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    docs = _docs()
    batch = {
        "input_ids": torch.cat([d[0] for d in docs])[None],
        "labels": torch.cat([d[1] for d in docs])[None],
        "position_ids": torch.cat([torch.arange(len(d[0])) for d in docs])[None],
        "document_ids": torch.cat([torch.full((len(d[0]),), i) for i, d in enumerate(docs)])[None],
        "source_ids": torch.zeros(1, sum(len(d[0]) for d in docs), dtype=torch.long),
    }
    with torch.no_grad():
        torch.testing.assert_close(objective.loss_sum(model, batch), _reference(model, docs), rtol=1e-5, atol=1e-5)
        assert objective.num_tokens(batch) == sum(int((d[1] != -100).sum()) for d in docs)
