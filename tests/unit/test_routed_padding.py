"""Every objective gives a mixture of experts the padding of its rows, which its routers leave out.

A tiny `MoETransformer` (two MoE blocks) runs each objective's ``loss_sum`` and backward on rows
with pad tails: packed pretraining (`trainer.data.packing.pack`, the text corpus's rows) and SFT rows
(the packer's ``source_ids`` -1), preference pairs
(`trainer.data.encode.pair_rows`) and GRPO rollout rows (`trainer.rl.rollout.rollout_rows`). The
routers' token count (the last statistic of each MoE layer) must be the rows' real tokens, counted
here from the rows' lengths, not from any mask plait builds. The layers' arithmetic with a mask is
tests/unit/test_moe.py's; the layouts, against a reference written out, tests/dist/test_expert_parallel.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from strategies.core.model_contract import declares, model_inputs
from trainer.data.encode import pair_rows, stack_rows
from trainer.data.packing import pack, rows_to_tensors
from trainer.models.llama import Llama
from trainer.models.moe_transformer import MoETransformer
from trainer.objectives.grpo import GRPO
from trainer.objectives.preference import DPO, ORPO
from trainer.objectives.pretrain import CausalLM
from trainer.objectives.sft import SFT
from trainer.rl.rollout import rollout_rows

SEQ, PAD = 16, 0


def _model() -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(
        vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, num_experts=4, top_k=2,
        moe_ffn_dim=16, balance_coef=0.01, z_loss_coef=0.001,
    )  # fmt: skip
    model.init_weights()
    return model


def _routed_tokens(model: MoETransformer) -> list[float]:
    return [moe.statistics[-1].item() for moe in model.moe_layers().values()]


def _packed() -> tuple[dict[str, torch.Tensor], int]:
    """Two rows: two samples (5 + 4 tokens) then 7 pad tokens; one sample of 12, then 4."""
    sample = lambda n, seed: (0, np.random.default_rng(seed).integers(1, 32, n), np.arange(n) % 32)  # noqa: E731
    rows = [[sample(5, 1), sample(4, 2)], [sample(12, 3)]]
    return rows_to_tensors(rows, num_rows=2, seq_len=SEQ, pad_id=PAD), 5 + 4 + 12


def _pairs() -> tuple[dict[str, torch.Tensor], int]:
    """Two pairs: prompt 3 + responses 4 and 2; prompt 5 + responses 6 and 1 (rows of 16)."""
    a, _ = pair_rows([1, 2, 3], [4, 5, 6, 7], [8, 9], seq_len=SEQ, max_prompt_len=8, pad_id=PAD)
    b, _ = pair_rows([1, 2, 3, 4, 5], [6] * 6, [7], seq_len=SEQ, max_prompt_len=8, pad_id=PAD)
    return stack_rows([a, b], SEQ), (3 + 4) + (3 + 2) + (5 + 6) + (5 + 1)


def test_pretraining_rows_mark_their_pad_tail():
    """`pack` (the text corpus's rows): documents of 10 and 12 tokens fill one row of 16 and 6 tokens
    of the next, whose 10-token pad tail the routers leave out."""
    rows = pack(
        [(list(range(1, 11)), list(range(2, 12))), (list(range(1, 13)), list(range(2, 14)))], seq_len=SEQ, pad_id=PAD
    )
    batch = rows[0:2]  # [2, 16] each
    model = _model()
    CausalLM().loss_sum(model, batch).backward()
    assert _routed_tokens(model) == [22, 22]


def test_packed_rows_sft_and_pretraining():
    batch, real = _packed()
    for objective in (SFT(groups=["a"]), CausalLM()):
        model = _model()
        objective.loss_sum(model, batch).backward()
        assert _routed_tokens(model) == [real, real], type(objective).__name__


@pytest.mark.parametrize("objective", [ORPO(), DPO()], ids=["orpo", "dpo"])
def test_preference_pairs(objective):
    batch, real = _pairs()
    model = _model()
    logps, _ = objective.sequence_logps_of(model, batch)
    logps.sum().backward()
    assert _routed_tokens(model) == [real, real]


def test_grpo_rollout_rows():
    rows = rollout_rows([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], []], width=SEQ, pad_id=PAD)
    batch = {**rows, "advantages": torch.tensor([1.0, -1.0])}
    model = _model()
    GRPO(num_generations=2).loss_sum(model, batch).backward()
    assert _routed_tokens(model) == [3 + 4 + 2] * 2


def test_a_dense_model_is_not_given_a_token_mask():
    """Only a forward that declares ``token_mask_bt`` gets it: a dense model (or one of a user's own)
    runs as before."""
    dense = Llama(vocab_size=32, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    batch, _ = _packed()
    assert not declares(dense, "token_mask_bt") and "token_mask_bt" not in model_inputs(dense, batch)
    assert model_inputs(_model(), batch)["token_mask_bt"].sum().item() == 21


def test_a_models_own_dense_feed_forward_is_not_given_the_mask():
    """A model's own [B, T, D] feed-forward (`Llama.make_feed_forward`) whose forward takes x alone runs
    as before; only one that declares ``token_mask_bt`` routes tokens."""

    class Linear(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.proj = nn.Linear(dim, dim)

        def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
            return self.proj(x_btd)

    class Own(Llama):
        def make_feed_forward(self, layer: int) -> nn.Module:
            return Linear(self.dim)

    model = Own(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    assert model(torch.randint(0, 32, (2, 8))).shape == (2, 8, 32)
    assert not any(layer.routes_tokens for layer in model.layers.values())
    assert all(layer.routes_tokens for layer in _model().layers.values())
