"""Case C16 — weight decay applied to embeddings, norms and biases (pytorch/torchtitan#2599).

Scenario: AdamW, lr 1e-3, weight_decay 0.1. One embedding row (initial value 1.0) whose token never
appears, 1000 steps.
Expected: with embeddings, norm weights and biases in a weight_decay=0 group, the row stays 1.0.
Decayed, it becomes 0.9048 ((1 - 1e-4)^1000 = 0.904833; torch AdamW gives 0.904818). Also the
grouping itself: only >=2-D matmul weights get decay by default, and the exclusion list is
configurable.

Exercises `trainer.optim.param_groups` on a small model and on plait's nano Llama, and the groups
that `Task.configure_optimizers` builds from a composed recipe (``optim.weight_decay``,
``train.no_decay``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import compose_config
from torch import nn

from trainer.build import build_task
from trainer.config import validate
from trainer.model_node import instantiate_model
from trainer.optim import param_groups

UNSEEN = 7  # the token that never appears


class Tiny(nn.Module):
    """Embedding -> norm -> linear with bias: one parameter of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 8, bias=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.tok_embeddings(ids)))


def names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in params)


def train_unseen_row(**group_kwargs) -> torch.Tensor:
    """AdamW(lr 1e-3, wd 0.1) over plait's groups for 1000 steps on tokens 0-3; the unseen row."""
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.tok_embeddings.weight[UNSEEN] = 1.0
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.1, **group_kwargs), lr=1e-3)
    ids, targets = torch.tensor([[0, 1, 2, 3]]), torch.tensor([1, 2, 3, 0])
    for _ in range(1000):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model.tok_embeddings.weight.grad[UNSEEN].abs().sum() == 0  # never had a gradient
    return model.tok_embeddings.weight[UNSEEN].detach()


def test_unseen_embedding_row_is_not_decayed():
    assert torch.equal(train_unseen_row(), torch.ones(4))


def test_unseen_embedding_row_decays_when_embeddings_are_decayed():
    row = train_unseen_row(no_decay=("norm", "bias"))
    torch.testing.assert_close(row, torch.full((4,), 0.9048), rtol=0, atol=1e-4)
    torch.testing.assert_close(row, torch.full((4,), 0.904818), rtol=0, atol=2e-6)


def test_default_grouping_decays_only_matmul_weights():
    model = Tiny()
    decayed, rest = param_groups(model, weight_decay=0.1)
    assert (decayed["weight_decay"], rest["weight_decay"]) == (0.1, 0.0)
    assert names(model, decayed["params"]) == ["proj.weight"]
    assert names(model, rest["params"]) == ["norm.bias", "norm.weight", "proj.bias", "tok_embeddings.weight"]


def test_llama_grouping_and_configurable_exclusions():
    model = instantiate_model(compose_config().model, vocab_size=64)
    matmuls = [
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    ] + ["output.weight"]
    decayed, rest = param_groups(model, weight_decay=0.1)
    assert names(model, decayed["params"]) == sorted(matmuls)
    assert "tok_embeddings.weight" in names(model, rest["params"])
    assert all(p.ndim == 1 for n, p in model.named_parameters() if n.endswith("norm.weight"))

    # The exclusion list is configurable: exclude the output head too, or nothing at all.
    decayed, _ = param_groups(model, weight_decay=0.1, no_decay=("tok_embeddings", "norm", "output"))
    assert names(model, decayed["params"]) == sorted(m for m in matmuls if m != "output.weight")
    decayed, rest = param_groups(model, weight_decay=0.1, no_decay=())
    assert names(model, decayed["params"]) == sorted(matmuls + ["tok_embeddings.weight"])
    assert all(p.ndim == 1 for p in rest["params"])  # norm gains are never decayed


@pytest.mark.parametrize(
    ("overrides", "decay", "excluded"),
    [
        (["optim=adamw", "optim.weight_decay=0.1"], 0.1, None),
        (["optim=adamw", "optim.weight_decay=0.0"], 0.0, None),
        (["optim=sgd"], 0.0, None),
        (["optim=adamw", "train.no_decay=[tok_embeddings,norm,output]"], 0.1, "output.weight"),
    ],
    ids=["adamw_wd0.1", "adamw_wd0", "sgd", "no_decay_output"],
)
def test_task_optimizer_groups_follow_the_config(overrides, decay, excluded):
    cfg = compose_config(overrides)
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model, vocab_size=64)
    task = build_task(cfg, validate(cfg), model)
    task.trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    optimizer = task.configure_optimizers()["optimizer"]
    decayed, rest = optimizer.param_groups
    assert (decayed["weight_decay"], rest["weight_decay"]) == (decay, 0.0)
    assert decay == cfg.optim.weight_decay
    assert "tok_embeddings.weight" in names(model, rest["params"])
    if excluded:
        assert excluded in names(model, rest["params"])
