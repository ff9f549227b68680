"""Case C03 — context parallelism normalises each shard by its own token count
(NVIDIA/Megatron-LM#7452 finding 9, fix PR #7513; NVIDIA/Megatron-LM#1764).

Scenario: CP=2, one 8-token row split 4 | 4 (load balancing off). Shard 0 has 3 supervised tokens
with CE [1, 1, 1], shard 1 has 1 with CE 5. Expected loss (1+1+1+5)/4 = 2.0 (the per-shard mean
gives 3.0) and the gradient of the unsharded run. Edge case: one supervised token (CE 2.0) on
shard 0 and none on the other shards gives 2.0 at CP=2 and CP=4 (the bug: 1.0 and 0.5); a shard
with no supervised token contributes exactly 0 loss and 0 gradient, never NaN.

Real gloo ranks run plait's Task and MeshStrategy (cp axis, `shard_batch` before the step counts
tokens over dp x cp) with the causal-LM objective on a per-token `TableLM`.
"""

from __future__ import annotations

import pytest
import torch
from controlled import ONE_SGD_STEP, TableLM, data_overrides, rows_from, table_overrides, token_ce
from harness import compose_config, fit, losses

from strategies.context.sharding import shard_batch
from trainer.data.packing import IGNORE_INDEX
from trainer.objectives.pretrain import CausalLM

SEQ_LEN = 8
CE = [3.0, 1.0, 5.0, 2.0]  # token 0: pad; 1: CE 1; 2: CE 5; 3: CE 2
I = IGNORE_INDEX
SCENARIO = ([1, 1, 1, 0, 2, 0, 0, 0], [0, 0, 0, I, 0, I, I, I])  # shards [1 1 1 _] | [2 _ _ _]
EDGE = ([3, 0, 0, 0, 0, 0, 0, 0], [0, I, I, I, I, I, I, I])  # one token, on shard 0


def scenario_rows():
    return rows_from([SCENARIO[0]], [SCENARIO[1]])


def edge_rows():
    return rows_from([EDGE[0]], [EDGE[1]])


def _fit(tmp_path, rows: str, overrides: list[str]) -> dict:
    cfg = compose_config(
        [
            *table_overrides(CE),
            *data_overrides(f"test_c03_cp_token_normalisation.{rows}", seq_len=SEQ_LEN),
            "data.shuffle=false",
            "train.global_batch_size=1",
            "train.micro_batch_size=1",
            *ONE_SGD_STEP,
            *overrides,
        ]
    )
    _, task = fit(cfg, tmp_path)
    (grads,) = [h["grads"] for h in task.history if "grads" in h]
    return {"loss": losses(task.history)[0], "grad": grads["layers.0.weight"]}


def union_grad(rows) -> torch.Tensor:
    model = TableLM(vocab_size=16, ce=CE)
    (token_ce(model, rows).sum() / (rows.labels != IGNORE_INDEX).sum()).backward()
    return model.layers[0].weight.grad


def cp(n: int, *, load_balance: bool = False) -> list[str]:
    return [
        "strategy=cp",
        f"trainer.devices={n}",
        f"strategy.context_parallel.load_balance={str(load_balance).lower()}",
    ]


def test_scenario_by_hand():
    rows = scenario_rows()
    ce = token_ce(TableLM(vocab_size=16, ce=CE), rows)
    assert ce.tolist() == pytest.approx([1, 1, 1, 0, 5, 0, 0, 0], abs=1e-6)
    batch = {"input_ids": rows.input_ids, "labels": rows.labels}
    counts = [CausalLM().num_tokens(shard_batch(batch, cp=2, rank=r, load_balance=False)).item() for r in range(2)]
    assert counts == [3, 1]


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
def test_cp2_normalises_by_the_global_count(tmp_path, load_balance):
    run = _fit(tmp_path, "scenario_rows", cp(2, load_balance=load_balance))
    assert run["loss"] == pytest.approx(2.0, abs=1e-6)  # the per-shard mean would give 3.0
    torch.testing.assert_close(run["grad"], union_grad(scenario_rows()), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [2, 4])
def test_zero_token_shards_add_nothing(tmp_path, n):
    run = _fit(tmp_path, "edge_rows", cp(n))
    assert run["loss"] == pytest.approx(2.0, abs=1e-6)  # the bug gives 1.0 at CP=2, 0.5 at CP=4
    torch.testing.assert_close(run["grad"], union_grad(edge_rows()), rtol=1e-6, atol=1e-7)


def test_a_shard_without_supervised_tokens_gives_exactly_zero():
    rows = edge_rows()
    batch = {"input_ids": rows.input_ids, "labels": rows.labels}
    model, objective = TableLM(vocab_size=16, ce=CE), CausalLM()
    for rank in (1, 2, 3):
        shard = shard_batch(batch, cp=4, rank=rank, load_balance=False)
        assert objective.num_tokens(shard).item() == 0
        loss = objective.loss_sum(model, shard)
        loss.backward()
        assert loss.item() == 0.0 and not torch.isnan(loss)
        assert torch.count_nonzero(model.layers[0].weight.grad) == 0
