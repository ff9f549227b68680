"""A data-parallel rank without held-out rows evaluates a stand-in row whose labels are all -100
(`trainer.data.loader.shard_rows`: every rank runs the same forwards). Pair objectives average over
pairs, not tokens, so the stand-in must count as no pair: the held-out loss and reward metrics of
one pair evaluated on 1, 2 or 4 ranks equal one process's. Before, the stand-in counted as a pair
with a loss (its reference log-prob against a zero policy log-prob): DPO's val/loss 0.570 on one
rank, 0.607 on two, 0.626 on four."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.data.loader import shard_rows
from trainer.objectives.kto import KTO
from trainer.objectives.preference import DPO, IPO, ORPO, SimPO

V, T = 5, 6


class Stub(nn.Module):
    """Fixed logits that depend on the input ids (a model the test controls)."""

    def forward(self, ids, position_ids_bt=None, document_ids_bt=None):
        base = torch.randn(1, T, V, generator=torch.Generator().manual_seed(0))
        return base.expand(ids.shape[0], T, V) + 0.3 * ids[..., None].float().sin()


def _rows(kto: bool) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[[1, 2, 3, 4, 0, 0], [1, 2, 4, 3, 2, 0]]])  # one pair (or row + mismatched row)
    labels = torch.tensor([[[-100, 3, 4, -100, -100, -100], [-100, 4, 3, 2, -100, -100]]])
    rows = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.arange(T).expand(1, 2, T).clone(),
        "document_ids": torch.zeros(1, 2, T, dtype=torch.long),
        "ref_logps": torch.tensor([[-6.0, -5.0]]),
    }
    return {**rows, "desirable": torch.tensor([1.0])} if kto else rows


def _evaluate(make, dp: int) -> tuple[float, float, dict[str, float]]:
    """``(loss, pairs, metrics)`` summed over ``dp`` ranks' shares, as the Task sums them."""
    objective, model, kto = make(), Stub(), make is KTO
    loss = pairs = 0.0
    for rank in range(dp):
        for batch in shard_rows(_rows(kto), dp_rank=rank, dp_size=dp, micro_batch_size=4):
            loss += float(objective.loss_sum(model, batch))
            pairs += float(objective.num_tokens(batch))
    names, sums = objective.pop_sums()
    return loss, pairs, {n: float(sums[0, i]) / max(float(sums[1, i]), 1.0) for i, n in enumerate(names)}


@pytest.mark.parametrize("make", [DPO, IPO, SimPO, ORPO, KTO], ids=lambda m: m.__name__)
def test_one_held_out_pair_on_more_ranks_than_pairs_scores_as_one_process(make) -> None:
    """Mutation: counting every row (the stand-in too) as a pair fails dp=2 and dp=4."""
    loss, pairs, metrics = _evaluate(make, 1)
    assert pairs == 1.0
    for dp in (2, 4):
        got_loss, got_pairs, got_metrics = _evaluate(make, dp)
        assert got_pairs == pairs, dp
        assert got_loss == pytest.approx(loss, rel=1e-6), dp
        assert got_metrics == pytest.approx(metrics, rel=1e-6), dp


def test_the_dpo_held_out_loss_is_the_pairs_own_on_every_rank_count() -> None:
    """The held-out DPO loss over 1, 2 and 4 ranks against the pair's loss written here:
    ``-log sigmoid(beta ((log pi_c - ref_c) - (log pi_r - ref_r)))`` from the stub's log-softmax at
    the response positions. Mutation: counting the stand-in row as a pair halves it at dp=2."""
    rows = _rows(kto=False)
    logp = torch.log_softmax(Stub()(rows["input_ids"][0]).double(), dim=-1)  # [2, T, V]: chosen, rejected
    labels = rows["labels"][0]
    seq = [sum(float(logp[r, t, labels[r, t]]) for t in range(T) if labels[r, t] != -100) for r in (0, 1)]
    ref = rows["ref_logps"][0].double().tolist()
    margin = 0.1 * ((seq[0] - ref[0]) - (seq[1] - ref[1]))
    want = float(-torch.nn.functional.logsigmoid(torch.tensor(margin, dtype=torch.float64)))
    for dp in (1, 2, 4):
        loss, pairs, _ = _evaluate(lambda: DPO(beta=0.1), dp)
        assert loss / pairs == pytest.approx(want, rel=1e-5), dp
