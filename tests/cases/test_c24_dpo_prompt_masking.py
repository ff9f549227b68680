"""C24: DPO log-probs sum over response tokens only, the rejected row's prompt included
(OpenRLHF#294 masked the prompt of the chosen rows only)."""

import pytest
from preference_pairs import FixedLogits, pair_batch

from trainer.objectives.pair_losses import dpo_loss, sequence_logps
from trainer.objectives.preference import DPO


def test_case_c24_rejected_logps_exclude_the_prompt():
    """C24: summed log-probs cover response tokens only, for chosen and rejected rows alike."""
    batch, policy_logits, full_labels = pair_batch(-5.0, -2.0, -3.0)
    _, ref_logits, _ = pair_batch(-6.0, -2.5, -2.8)
    objective = DPO(beta=0.1)
    ref_logps, _ = objective.sequence_logps_of(FixedLogits(ref_logits), batch)
    logps, tokens = objective.sequence_logps_of(FixedLogits(policy_logits), batch)
    assert tokens.tolist() == [[2.0, 3.0]]  # per-row target count == completion length, both rows
    assert logps[0].tolist() == pytest.approx([-2.0, -3.0], abs=1e-5)
    assert ref_logps[0].tolist() == pytest.approx([-2.5, -2.8], abs=1e-5)
    loss = objective.loss_sum(FixedLogits(policy_logits), {**batch, "ref_logps": ref_logps})
    assert loss.item() == pytest.approx(0.658760, abs=1e-5)
    # The bug (the rejected row's prompt summed too) flips the preference: margin -0.3, loss 0.708260.
    buggy_rejected, _ = sequence_logps(policy_logits[1:], full_labels[1:])
    buggy_ref, _ = sequence_logps(ref_logits[1:], full_labels[1:])
    buggy, _, _ = dpo_loss(logps[:, 0] - ref_logps[:, 0], buggy_rejected - buggy_ref, beta=0.1)
    assert buggy.item() == pytest.approx(0.708260, abs=1e-5)
