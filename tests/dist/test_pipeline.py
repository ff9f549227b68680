"""Pipeline parallelism equals one process: every schedule, PP x FSDP, and accumulation over schedule steps.

fp32, a nano Llama with 4 layers (so interleaved and V schedules get one layer per stage), global
batch 8 of 64-token packed rows with unequal supervised-token counts, 2 steps of SGD with momentum
0.9 and no clipping. Each run is `Task` + `MeshStrategy` in forked gloo ranks; it is compared with
plait on one process (the whole batch in one forward, itself checked against a plain loop in
test_equivalence.py): loss and gradient (gathered over all stages) at each step, parameters after
the 2 steps, within ``TOL``. Validation losses (a forward through the stages) match too.

Layouts: 2 ranks, 2 stages (4 for the interleaved and V schedules), 4 micro-batches of 2 rows in
one schedule step; PP2 x FSDP2 on 4 ranks; and gradient accumulation over K = 1, 2, 4 schedule
steps, each compared with the same K without pipelining. Last, a 4-stage checkpoint resumes on
one process and on 2 stages (DCP reshards; names are global layer indices on every stage).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from harness import EXACT_SGD, compose_config, fit, losses

STEPS = 2
TOL = {"rtol": 1e-5, "atol": 1e-5}
COMMON = (
    "model.n_layers=4",
    *EXACT_SGD,
    f"trainer.max_steps={STEPS}",
    "+callbacks.grads._target_=harness.GradRecorder",
    "+callbacks.params._target_=harness.ParamRecorder",
)
PP2 = ("strategy=pp", "trainer.devices=2")
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBV", "DualPipeV"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Short documents: about one document end (label -100) per 64-token row."""
    rng, words = random.Random(0), "thou art more lovely and temperate rough winds do shake the buds of may".split()
    path = tmp_path_factory.mktemp("corpus") / "short_docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 30)))}) + "\n" for _ in range(600)))
    return str(path)


def _run(overrides, run_dir, corpus) -> dict:
    _, task = fit(compose_config([*COMMON, f"data.path={corpus}", *overrides]), run_dir)
    return _result(task)


def _result(task) -> dict:
    return {
        "loss": losses(task.history),
        "val_loss": [h["val_loss"] for h in task.history if "val_loss" in h],
        "grad_norm": [h["grad_norm"] for h in task.history if "loss" in h],
        "grads": [h["grads"] for h in task.history if "grads" in h],
        "params": [h["params"] for h in task.history if "params" in h][0],
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus) -> dict:
    return _run(["train.micro_batch_size=8"], tmp_path_factory.mktemp("one_process"), corpus)


def assert_equivalent(run: dict, expected: dict, *, val: bool = True) -> None:
    assert len(run["loss"]) == len(run["grads"]) == STEPS
    assert set(run["params"]) == set(expected["params"]), "every stage's parameters, each once"
    for step in range(STEPS):
        torch.testing.assert_close(run["loss"][step], expected["loss"][step], **TOL, msg=f"loss at step {step + 1}")
        torch.testing.assert_close(run["grads"][step], expected["grads"][step], **TOL, msg=f"grads at step {step + 1}")
    assert run["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    torch.testing.assert_close(run["params"], expected["params"], **TOL, msg=f"parameters after {STEPS} SGD steps")
    if val:
        torch.testing.assert_close(run["val_loss"], expected["val_loss"], **TOL, msg="validation losses")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_equals_one_process(tmp_path, corpus, schedule, one_process):
    run = _run([*PP2, f"strategy.pipeline.schedule={schedule}", "train.micro_batch_size=2"], tmp_path, corpus)
    assert_equivalent(run, one_process)


def test_auto_split_equals_one_process(tmp_path, corpus, one_process):
    """strategy.pipeline.split=auto: the planner puts 3 blocks with the embedding and 1 with the head."""
    overrides = [*PP2, "strategy.pipeline.split=auto", "train.micro_batch_size=2", "+callbacks.layers._target_=harness.StageLayers"]
    _, task = fit(compose_config([*COMMON, f"data.path={corpus}", *overrides]), tmp_path)
    assert [h["layers"] for h in task.history if "layers" in h] == [["0", "1", "2"]]  # rank 0: stage 0
    assert_equivalent(_result(task), one_process)


def test_pp2_x_fsdp2_equals_one_process(tmp_path, corpus, one_process):
    layout = ["strategy=pp", "trainer.devices=4", "strategy.pp=2", "strategy.dp_shard=2", "train.micro_batch_size=2"]
    run = _run(layout, tmp_path, corpus)
    # The 3 validation rows of this corpus are trimmed to a multiple of dp=2 (TextDataModule.eval_dataloader).
    assert_equivalent(run, one_process, val=False)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_over_schedule_steps_equals_no_pp(tmp_path, corpus, k, one_process):
    """K schedule steps of 2 micro-batches per optimizer step (K = 1 is the 1F1B case above)."""
    micro = 8 // (2 * k)
    piped = _run([*PP2, "strategy.pipeline.num_microbatches=2", f"train.micro_batch_size={micro}"], tmp_path / "pp", corpus)
    plain = _run([f"train.micro_batch_size={8 // k}"], tmp_path / "plain", corpus)  # K accumulation steps, no pipeline
    assert_equivalent(piped, plain)
    assert_equivalent(piped, one_process)


FOUR_STEPS = (
    "callbacks.checkpoint.every_n_steps=2", "callbacks.checkpoint.keep_last=0", "train.micro_batch_size=2",
    "trainer.max_steps=4",
)


@pytest.fixture(scope="module")
def four_stages(tmp_path_factory, corpus) -> tuple:
    """Interleaved1F1B, 4 stages on 2 ranks, 4 steps; checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("four_stages")
    history = _run_history([*PP2, "strategy.pipeline.schedule=Interleaved1F1B", *FOUR_STEPS], run_dir, corpus)
    return run_dir / "checkpoints" / "step_0000002", history


@pytest.mark.parametrize(
    "layout", [("trainer.devices=1",), ("strategy=pp", "trainer.devices=2", "strategy.pipeline.schedule=1F1B")], ids=["pp1", "pp2_2stages"]
)
def test_checkpoint_of_4_stages_resumes_at_another_pp_degree(tmp_path, corpus, four_stages, layout):
    """DCP reshards the 4-stage checkpoint (parameters and momentum) to 1 stage or 2 stages."""
    checkpoint, straight = four_stages
    resumed = _run_history([*layout, *FOUR_STEPS], tmp_path, corpus, ckpt_path=str(checkpoint))
    expected, got = (
        {h["step"]: h["loss"] for h in history if "loss" in h} for history in (straight, resumed)
    )
    assert sorted(got) == [1, 2, 3, 4] and got[3] != got[2]
    for step in (3, 4):  # trained after the resume, from resharded parameters and momentum
        assert got[step] == pytest.approx(expected[step], abs=1e-5), step
    (params,), (expected_params,) = ([h["params"] for h in history if "params" in h] for history in (resumed, straight))
    torch.testing.assert_close(params, expected_params, **TOL)


def _run_history(overrides, run_dir, corpus, ckpt_path=None) -> list:
    cfg = compose_config([*COMMON, f"data.path={corpus}", *overrides])
    return fit(cfg, run_dir, ckpt_path=ckpt_path)[1].history
