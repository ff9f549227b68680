"""KTO's loss and gradients equal TRL's formula (KTOTrainer.kto_loss, reimplemented here from its
source: chosen/rejected selected by label, KL = mean of the mismatched rows' log-ratios gathered
over processes and clamped at 0, losses concatenated and averaged), within 1e-6, through plait's
public API: `KTO.loss_sum` on a small model whose log-probs this test computes itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.compose import compose
from trainer.config import ConfigError, validate
from trainer.objectives.kto import KTO


class Bigram(nn.Module):
    """logits[t] = W[input_ids[t]]: the model plait's objective runs (same call signature)."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, input_ids, position_ids_bt=None, document_ids_bt=None):
        return self.table[input_ids]


def trl_kto(policy_logps_row, policy_logps_kl, ref_row, ref_kl, labels, *, beta, dw, uw):
    """TRL's kto_loss (loss_type="kto"), one process: returns losses.mean()."""
    kl = (policy_logps_kl - ref_kl).mean().detach().clamp(min=0)
    chosen = [i for i in range(len(labels)) if labels[i]]
    rejected = [i for i in range(len(labels)) if not labels[i]]
    chosen_losses = 1 - torch.sigmoid(beta * ((policy_logps_row[chosen] - ref_row[chosen]) - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - (policy_logps_row[rejected] - ref_row[rejected])))
    return torch.cat((dw * chosen_losses, uw * rejected_losses), 0).mean()


def summed_logps(table, input_ids, labels):
    """Summed log p(label) of each row, written out: log_softmax, gather, mask."""
    logp = torch.log_softmax(table[input_ids], -1)
    mask = labels != -100
    picked = torch.gather(logp, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def _batch(pairs=6, length=9, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (pairs, 2, length), generator=g)
    labels = torch.full_like(ids, -100)
    labels[..., 4:-1] = ids[..., 5:]  # targets on the completion tokens only
    return {
        "input_ids": ids, "labels": labels,
        "position_ids": torch.arange(length).expand(pairs, 2, length).clone(),
        "document_ids": torch.zeros_like(ids),
        "ref_logps": -torch.rand(pairs, 2, generator=g) * 20 - 5,
        "desirable": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])[:pairs],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("beta", "dw", "uw", "ref_shift"), [(0.1, 1.0, 1.0, 0.0), (0.5, 1.33, 0.7, 0.0), (0.3, 1.0, 2.0, 40.0)]
)
def test_kto_loss_and_gradients_equal_trl_formula(beta, dw, uw, ref_shift):
    # ref_shift 40 makes the mismatched rows' mean log-ratio negative: the KL clamps at 0.
    # ref_shift 0 (ref log-probs well below the policy's) gives a positive KL.
    torch.manual_seed(1)
    batch = _batch()
    batch["ref_logps"] = batch["ref_logps"] - 30.0 + ref_shift
    model = Bigram()
    expected_model = Bigram()
    expected_model.load_state_dict(model.state_dict())

    objective = KTO(beta=beta, desirable_weight=dw, undesirable_weight=uw)
    got = objective.loss_sum(model, batch) / batch["input_ids"].shape[0]  # the Task divides by rows
    got.backward()

    logps = summed_logps(expected_model.table, batch["input_ids"], batch["labels"])
    labels = [bool(x) for x in batch["desirable"]]
    want = trl_kto(
        logps[:, 0], logps[:, 1], batch["ref_logps"][:, 0], batch["ref_logps"][:, 1], labels, beta=beta, dw=dw, uw=uw
    )
    want.backward()
    kl = (logps[:, 1] - batch["ref_logps"][:, 1]).mean()
    assert (kl > 0) == (ref_shift == 0.0)  # both regimes of the clamp are exercised
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.table.grad, expected_model.table.grad, rtol=0, atol=1e-6)
    names, sums = objective.pop_sums()
    assert names == ["rewards/chosen", "rewards/rejected", "rewards/mismatched", "kl"]
    assert sums[1].tolist() == [3.0, 3.0, 6.0, 1.0]
    assert sums[0, 2].item() / 6 == pytest.approx(
        beta * kl.item(), abs=1e-5
    )  # the mismatched rows' mean reward, unclamped
    assert sums[0, 3].item() == pytest.approx(max(kl.item(), 0.0), abs=1e-5)


def _refusals(recipe: str, *overrides: str) -> list[str]:
    """The problems `trainer.config.validate` finds in ``plait <recipe> <overrides>`` ([] when valid)."""
    try:
        validate(compose(recipe, list(overrides)))
    except ConfigError as err:
        return err.problems
    return []


def test_kto_needs_unpaired_rows_and_pairs_refuse_them():
    """The objective's declared row kind against the data module's (`DataModule.row_kind_of`):
    mutating `PreferenceDataModule.row_kind_of` to ignore ``unpaired`` fails both refusals."""
    assert any(
        "objective KTO trains on unpaired rows; set data.unpaired=true" in p
        for p in _refusals("kto", "data.unpaired=false")
    )
    assert _refusals("kto") == []
    assert any(
        "objective DPO trains on pairs; remove data.unpaired=true" in p for p in _refusals("dpo", "data.unpaired=true")
    )
    with pytest.raises(ValueError, match="objective.desirable_weight=0"):
        KTO(desirable_weight=0)
