"""Case C02 — loss averaged per rank instead of per token across data-parallel ranks
(huggingface/transformers#34373; pytorch/torchtitan#2318).

Scenario: W=2. Rank 0 has 1 supervised token (CE 4.0); rank 1 has 9 supervised tokens (CE 1.0 each).
Expected: global loss = 13/10 = 1.3 (the per-rank mean gives (4.0 + 1.0)/2 = 2.5), and the gradient
equals the single-process gradient on the union of both batches. Gradient norm and update are the
same for one process, DDP W=2, FSDP W=2 and HSDP 2x2 (the double division makes them W x too small).

Real gloo ranks run plait's Task and MeshStrategy with the causal-LM objective on a `TableLM`
(tests/cases/controlled.py). The global batch is [A, E, B, E], E a row without supervised tokens:
at W=2 rank 0 takes [A, E] (1 token) and rank 1 [B, E] (9 tokens); at W=4 each rank takes one row
(two ranks have no supervised token and must contribute exactly 0, never NaN).
"""

from __future__ import annotations

import pytest
import torch
from controlled import ONE_SGD_STEP, TableLM, data_overrides, row, rows_from, table_overrides, token_ce
from harness import compose_config, fit, losses

from trainer.data.packing import IGNORE_INDEX

SEQ_LEN = 10
CE = [2.0, 4.0, 1.0]  # token 1: CE 4.0 (rank 0's token), token 2: CE 1.0 (rank 1's tokens); 0 is the pad
ROW_A, ROW_B, ROW_E = row([1], SEQ_LEN), row([2] * 9, SEQ_LEN), row([], SEQ_LEN)
LAYOUTS = {
    "one_process": ["trainer.devices=1", "train.micro_batch_size=4"],
    "ddp2": ["strategy=ddp", "trainer.devices=2", "train.micro_batch_size=2"],
    "fsdp2": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=1"],
    "hsdp2x2": [
        "strategy=fsdp",
        "strategy.dp_replicate=2",
        "strategy.dp_shard=2",
        "trainer.devices=4",
        "train.micro_batch_size=1",
    ],
}


def rows():
    order = [ROW_A, ROW_E, ROW_B, ROW_E]
    return rows_from([r[0] for r in order], [r[1] for r in order])


def _fit(tmp_path, layout: str) -> dict:
    cfg = compose_config(
        [
            *table_overrides(CE),
            *data_overrides("test_c02_dp_token_weighting.rows", seq_len=SEQ_LEN),
            "data.shuffle=false",
            "train.global_batch_size=4",
            *ONE_SGD_STEP,
            "+callbacks.params._target_=harness.ParamRecorder",
            *LAYOUTS[layout],
        ]
    )
    _, task = fit(cfg, tmp_path / layout)
    (step,) = [h for h in task.history if "loss" in h]
    (grads,) = [h["grads"] for h in task.history if "grads" in h]
    (params,) = [h["params"] for h in task.history if "params" in h]
    return {"loss": losses(task.history)[0], "grad_norm": step["grad_norm"], "grads": grads, "params": params}


@pytest.fixture(scope="module")
def union():
    """The single-process gradient on the union of both ranks' rows, by hand (sum CE / 10 tokens)."""
    model = TableLM(vocab_size=16, ce=CE)
    batch = rows()
    loss = token_ce(model, batch).sum() / (batch.labels != IGNORE_INDEX).sum()
    loss.backward()
    grad = model.layers[0].weight.grad
    return {"loss": loss.item(), "grad": grad, "grad_norm": grad.norm().item()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("c02"), "one_process")


def test_scenario_by_hand(union):
    batch = rows()
    ce = token_ce(TableLM(vocab_size=16, ce=CE), batch)
    torch.testing.assert_close(ce[batch.labels.flatten() != IGNORE_INDEX], torch.tensor([4.0] + [1.0] * 9))
    assert union["loss"] == pytest.approx(1.3, abs=1e-6)


def test_one_process_on_the_union(one_process, union):
    assert one_process["loss"] == pytest.approx(1.3, abs=1e-6)
    torch.testing.assert_close(one_process["grads"]["layers.0.weight"], union["grad"], rtol=1e-6, atol=1e-7)
    assert one_process["grad_norm"] == pytest.approx(union["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("layout", ["ddp2", "fsdp2", "hsdp2x2"])
def test_data_parallel_equals_one_process(tmp_path, layout, one_process, union):
    run = _fit(tmp_path, layout)
    assert run["loss"] == pytest.approx(1.3, abs=1e-6)
    torch.testing.assert_close(run["grads"]["layers.0.weight"], union["grad"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(run["grads"], one_process["grads"], rtol=1e-6, atol=1e-7)
    assert run["grad_norm"] == pytest.approx(one_process["grad_norm"], rel=1e-6)
    assert run["grad_norm"] == pytest.approx(union["grad_norm"], rel=1e-6)
    # The update: parameters after one SGD step.
    torch.testing.assert_close(run["params"], one_process["params"], rtol=1e-6, atol=1e-7)
    assert not torch.equal(run["params"]["layers.0.weight"], TableLM(vocab_size=16, ce=CE).layers[0].weight)
