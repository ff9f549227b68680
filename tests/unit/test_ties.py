"""Weights tied before a re-materialisation are one tensor after it (`strategies.transforms.ties`,
`strategies.meta_init.materialize`).

torch's own ``to_empty`` is the hazard: from the meta device it stores a new ``Parameter`` in each
slot, so a tied pair comes back as two tensors (the first test pins that behaviour, which the fix
exists for). The reference of the Llama test is a one-process model the test ties itself: plait's
untied Llama of the same seed with its head pointed at its embedding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strategies.meta_init import materialize
from strategies.transforms.ties import keep_ties, tied_slots
from trainer.models.llama import Llama

NANO = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


class Shared(nn.Module):
    """An embedding and a head sharing one weight, and two children sharing one buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.a, self.b = nn.Module(), nn.Module()
        self.a.register_buffer("table", torch.zeros(4))
        self.b.register_buffer("table", self.a.table)


def test_torch_to_empty_unties_plain_parameters_from_meta():
    with torch.device("meta"):
        model = Shared()
    model.to_empty(device="cpu")
    assert model.head.weight is not model.embed.weight
    assert model.b.table is not model.a.table


def test_keep_ties_reties_parameters_and_buffers():
    with torch.device("meta"):
        model = Shared()
    assert tied_slots(model) == [[("embed", "weight"), ("head", "weight")], [("a", "table"), ("b", "table")]]
    with keep_ties(model):
        model.to_empty(device="cpu")
    assert model.head.weight is model.embed.weight and isinstance(model.head.weight, nn.Parameter)
    assert model.b.table is model.a.table
    assert [n for n, _ in model.named_parameters()] == ["embed.weight"]


def test_keep_ties_refuses_tied_slots_laid_out_apart():
    model = Shared()
    with pytest.raises(
        ValueError, match=r"embed\.weight and head\.weight are one tied tensor.*model\.tie_embeddings=false"
    ):
        with keep_ties(model):
            model.head.weight = nn.Parameter(torch.zeros(5, 4))


def test_materialize_keeps_a_meta_built_llama_tied_with_the_one_process_weights():
    torch.manual_seed(7)
    reference = Llama(**NANO, tie_embeddings=False)
    reference.output.weight = reference.tok_embeddings.weight  # the test's own tie
    torch.manual_seed(7)
    with torch.device("meta"):
        model = Llama(**NANO, tie_embeddings=True)
    materialize(model, torch.device("cpu"))
    assert model.output.weight is model.tok_embeddings.weight
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
