"""`data.balance=work` trains the same steps as one process on the unbalanced global batch.

The planner only reorders each step's rows over dp ranks and micro-batches, and the Task divides
the summed token loss by the step's global supervised-token count, so losses, gradients and
parameters equal a plain one-process loop on the rows in the sampler's order.

fp32, nano Llama, global batch 8 of 64-token rows, 5 steps of SGD with momentum (constant lr, no
clipping). The corpus is a long tail: most documents are a few words, some fill whole rows, so
rows differ in causal work (the planner moves rows) and in supervised tokens (only a globally
normalised step matches). The reference is written here: plait's initial weights, the rows of
`GlobalBatchSampler(dp_size=1)`, one forward of the 8 rows, loss = summed token CE / supervised
tokens of the step. Tolerance: rtol = atol = 1e-6.

The DDP 2 layout runs in the default suite; FSDP 2 x CP 2 and HSDP 2 x 2 (4 gloo ranks) are slow::

    timeout 1800 python -m pytest tests/dist/test_balance_equivalence.py -m slow -q
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from harness import EXACT_SGD, assert_equals_reference, compose_config, fit, reference_run, train_rows
from trainer.build import build_data
from trainer.config import validate
from trainer.data.balance import WorkModel
from trainer.data.packing import IGNORE_INDEX

STEPS = 5
TOL = {"rtol": 1e-6, "atol": 1e-6}
COMMON = (
    *EXACT_SGD,
    f"trainer.max_steps={STEPS}",
    "+callbacks.grads._target_=harness.GradRecorder",
    "+callbacks.params._target_=harness.ParamRecorder",
)
LAYOUTS = {
    # + the telemetry of trainer.callbacks.balance, checked against the planned order's work
    "ddp2_ga2": pytest.param(
        ["strategy=ddp", "trainer.devices=2", "train.micro_batch_size=2", "callbacks.balance.enabled=true", "logger=csv"],
        id="ddp2_ga2",
    ),
    "fsdp2_x_cp2": pytest.param(
        ["strategy=nd", "strategy.dp_shard=2", "strategy.cp=2", "trainer.devices=4", "train.micro_batch_size=2"],
        id="fsdp2_x_cp2", marks=pytest.mark.slow,
    ),
    "hsdp2x2": pytest.param(
        ["strategy=hsdp", "trainer.devices=4", "train.micro_batch_size=1"], id="hsdp2x2", marks=pytest.mark.slow
    ),
}
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """400 documents: 3 to 12 words, or (one in four) 40 to 120 words (whole 64-token rows)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "long_tail.jsonl"
    sizes = [rng.randint(40, 120) if rng.random() < 0.25 else rng.randint(3, 12) for _ in range(400)]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=k))}) + "\n" for k in sizes))
    return str(path)


@pytest.fixture(scope="module")
def ref(corpus) -> dict:
    """Plain PyTorch on one process, rows in the sampler's order: one forward of the step's 8 rows."""
    cfg = compose_config([*COMMON, f"data.path={corpus}"])
    return reference_run(cfg, STEPS)


def _planned(cfg) -> tuple[int, list[float]]:
    """Steps of the run whose rows the planner moves to another rank or micro-batch, and each
    step's estimated work max/mean over the dp ranks after planning."""
    run = validate(cfg)
    data, dp = build_data(cfg, run), run.dims.dp
    batches = data.train_batches(0, 1)  # every rank's rows: the sampler's order
    moved, ratios = 0, []
    for _, (batch, _, _) in zip(range(STEPS), batches.batches(batches.start())):
        order = data.balancer.order(batch["document_ids"], dp)
        moved += not torch.equal(order, torch.arange(8))
        work = WorkModel.of(run.shape).rows(batch["document_ids"][order]).reshape(dp, -1).sum(1)
        ratios.append(float(work.max() / work.mean()))
    return moved, ratios


@pytest.mark.parametrize("overrides", list(LAYOUTS.values()))
def test_balanced_layout_equals_one_process(tmp_path, corpus, ref, overrides):
    cfg = compose_config([*COMMON, f"data.path={corpus}", "data.balance=work", *overrides])
    moved, ratios = _planned(cfg)
    assert moved >= 3  # the test is not vacuous: balancing reorders most steps
    counts = {(r != IGNORE_INDEX).sum().item() for r in build_data(cfg).prepare().train.labels[:40]}
    assert len(counts) > 3  # rows of unequal supervised-token counts
    _, task = fit(cfg, tmp_path)
    assert_equals_reference(task.history, ref, STEPS, **TOL)
    if "callbacks.balance.enabled=true" in overrides:
        rows = train_rows(tmp_path)
        logged = [float(rows[k]["perf/balance_work_max_over_mean"]) for k in range(1, STEPS + 1)]
        assert logged == pytest.approx(ratios, rel=1e-9)
        assert all(float(rows[k]["perf/balance_time_max_over_mean"]) >= 1.0 for k in range(1, STEPS + 1))
        for k in range(1, STEPS + 1):  # the compute before the gradient sync: a part of the step
            assert float(rows[k]["perf/balance_compute_max_over_mean"]) >= 1.0
            assert 0.0 < float(rows[k]["perf/compute_s_mean"]) <= float(rows[k]["perf/compute_s_max"])
