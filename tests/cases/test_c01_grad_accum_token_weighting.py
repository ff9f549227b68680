"""Case C01 — gradient accumulation takes a mean of micro-batch means (huggingface/transformers#34191).

Scenario: GA=2, one sequence per micro-batch, both padded to 8 positions with -100. Micro-batch A
has 2 supervised tokens with CE [1.0, 3.0]; micro-batch B has 6 supervised tokens, each CE 0.5.
Expected: optimised and logged loss = (1 + 3 + 6 * 0.5) / 8 = 0.875, the same as GA=1 with both
rows in one batch (the mean of means gives (2.0 + 0.5) / 2 = 1.25); parameter gradients after GA=2
equal the GA=1 gradients on the same data (rtol 1e-5).

Driven through plait's real step: a fit of `Task` + `MeshStrategy` (forked rank) with the real
causal-LM objective, on a `TableLM` whose per-token CE is set at init (tests/cases/controlled.py).
"""

from __future__ import annotations

import pytest
import torch
from controlled import ONE_SGD_STEP, TableLM, data_overrides, row, rows_from, table_overrides, token_ce
from harness import compose_config, fit, losses

from trainer.data.packing import IGNORE_INDEX

SEQ_LEN = 8
# Token 1 has CE 1.0, token 2 CE 3.0, token 3 CE 0.5 (token 0 is the pad).
CE = [2.0, 1.0, 3.0, 0.5]
ROW_A = row([1, 2], SEQ_LEN)
ROW_B = row([3] * 6, SEQ_LEN)


def rows():
    return rows_from([ROW_A[0], ROW_B[0]], [ROW_A[1], ROW_B[1]])


def _fit(tmp_path, micro_batch_size: int):
    cfg = compose_config(
        [
            *table_overrides(CE),
            *data_overrides("test_c01_grad_accum_token_weighting.rows", seq_len=SEQ_LEN),
            "data.shuffle=false",
            "train.global_batch_size=2",
            f"train.micro_batch_size={micro_batch_size}",
            *ONE_SGD_STEP,
        ]
    )
    _, task = fit(cfg, tmp_path / f"micro{micro_batch_size}")
    (grads,) = [h["grads"] for h in task.history if "grads" in h]
    return losses(task.history), grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("c01")
    return {"ga2": _fit(tmp, micro_batch_size=1), "ga1": _fit(tmp, micro_batch_size=2)}


def test_scenario_per_token_ce():
    batch = rows()
    ce = token_ce(TableLM(vocab_size=16, ce=CE), batch)
    torch.testing.assert_close(ce[batch.labels.flatten() != IGNORE_INDEX], torch.tensor([1.0, 3.0] + [0.5] * 6))


@pytest.mark.parametrize("run", ["ga2", "ga1"])
def test_logged_loss_is_token_weighted_mean(runs, run):
    (loss,) = runs[run][0]
    assert loss == pytest.approx(0.875, abs=1e-6)
    assert loss != pytest.approx(1.25, abs=1e-3)


def test_ga2_gradients_equal_ga1_and_the_token_mean(runs):
    ga2, ga1 = runs["ga2"][1], runs["ga1"][1]
    assert ga2.keys() == ga1.keys() == {"layers.0.weight"}
    torch.testing.assert_close(ga2["layers.0.weight"], ga1["layers.0.weight"], rtol=1e-5, atol=1e-7)

    # The one-big-batch gradient by hand: sum of token CE over both rows / 8 supervised tokens.
    model = TableLM(vocab_size=16, ce=CE)
    (token_ce(model, rows()).sum() / 8).backward()
    torch.testing.assert_close(ga2["layers.0.weight"], model.layers[0].weight.grad, rtol=1e-5, atol=1e-7)
