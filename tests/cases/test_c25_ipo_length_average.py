"""C25: IPO uses length-averaged log-ratios (torchtune#1291, trl#1265): the loss does not move
when every completion is twice as long."""

import pytest
import torch
from preference_pairs import FixedLogits, pair_batch

from trainer.objectives.pair_losses import ipo_loss
from trainer.objectives.preference import IPO

t = torch.tensor


def _c25_batch(repeat: int):
    c, r = 4 * repeat, 2 * repeat
    policy = pair_batch(-1.0, -1.0 * c, -2.0 * r, chosen=c, rejected=r, seq_len=16)
    ref = pair_batch(-1.0, -1.5 * c, -1.8 * r, chosen=c, rejected=r, seq_len=16)
    return policy[0], policy[1], ref[1]


@pytest.mark.parametrize("repeat", [1, 2])
def test_case_c25_ipo_uses_length_averaged_logratios(repeat):
    """C25: h = 0.7, loss (0.7 - 5)^2 = 18.49, unchanged when each completion is twice as long."""
    batch, policy_logits, ref_logits = _c25_batch(repeat)
    objective = IPO(beta=0.1)
    ref_logps, _ = objective.sequence_logps_of(FixedLogits(ref_logits), batch)
    loss = objective.loss_sum(FixedLogits(policy_logits), {**batch, "ref_logps": ref_logps})
    assert loss.item() == pytest.approx(18.49, abs=1e-3)
    # Summed log-ratios (the bug) give h = 2.4 (repeat 1) or 4.8 (repeat 2): loss 6.76 or 0.04.
    summed, _, _ = ipo_loss(t([2.0 * repeat]), t([-0.4 * repeat]), t([1.0]), t([1.0]), beta=0.1)
    assert summed.item() == pytest.approx({1: 6.76, 2: 0.04}[repeat], abs=1e-4)
