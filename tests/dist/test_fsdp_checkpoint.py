"""Resharding resume: a checkpoint written by FSDP2 on 2 ranks resumes on 1 and on 4 ranks, and one
written by tensor parallelism on 2 ranks (tp=2) resumes on one process (tp=1); each run continues
as the uninterrupted one.

DCP reshards parameters and the flattened optimizer state to the new layout; the sampler's global
batches do not depend on the world size, so steps 3 and 4 see the same rows at any world size.
SGD with momentum (not Adam, whose 1/sqrt(v) magnifies fp32 rounding) keeps the numbers tight,
and the momentum buffers make step 4 depend on the resharded optimizer state: the steps trained after
the resume (3 and 4) and the final parameters are compared with the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import compose_config, fit

RUN = (
    "optim=sgd",
    "trainer.max_steps=4",
    "train.micro_batch_size=2",  # 4 / 2 / 1 micro-batches at 1 / 2 / 4 ranks: one row split for all
    "callbacks.checkpoint.every_n_steps=2",
    "callbacks.checkpoint.keep_last=0",
    "+callbacks.params._target_=harness.ParamRecorder",
)


def step_losses(history: list[dict[str, Any]]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def final_params(history: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return [h["params"] for h in history if "params" in h][-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """FSDP2 on 2 ranks, 4 steps, checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("fsdp2")
    _, task = fit(compose_config(["strategy=fsdp", "trainer.devices=2", *RUN]), run_dir)
    return run_dir / "checkpoints" / "step_0000002", task.history


@pytest.mark.parametrize(
    "layout",
    [
        ("strategy=ddp", "trainer.devices=1"),
        # Also across activation checkpointing off -> on: parameter names and DCP keys are unchanged.
        ("strategy=fsdp", "trainer.devices=4", "strategy.activation_checkpoint.mode=full"),
    ],
    ids=["world1", "world4_ac"],
)
def test_fsdp_checkpoint_resumes_at_another_world_size(uninterrupted, layout: tuple[str, ...], tmp_path: Path) -> None:
    checkpoint, reference = uninterrupted
    assert checkpoint.is_dir() and sorted(step_losses(reference)) == [1, 2, 3, 4]
    _, task = fit(compose_config([*layout, *RUN]), tmp_path, ckpt_path=str(checkpoint))

    resumed, expected = step_losses(task.history), step_losses(reference)
    # Steps 1-2 are the checkpoint's history (restored, not recomputed: no evidence of resharding);
    # steps 3-4 are trained here and compared with the uninterrupted run. Step 3's loss is the
    # restored parameters'; step 4's and the final parameters follow the restored momentum (an
    # optimizer state not restored fails them).
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - expected[step]) <= 1e-6, (step, resumed[step], expected[step])
    assert resumed[3] != resumed[2]  # it did train on

    params, expected_params = final_params(task.history), final_params(reference)
    assert params.keys() == expected_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected_params[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def uninterrupted_tp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Tensor parallelism on 2 ranks (the weights sharded by rows/columns), 4 steps."""
    run_dir = tmp_path_factory.mktemp("tp2")
    _, task = fit(compose_config(["strategy=tp", "trainer.devices=2", *RUN]), run_dir)
    return run_dir / "checkpoints" / "step_0000002", task.history


def test_tp_checkpoint_resumes_at_tp1(uninterrupted_tp, tmp_path: Path) -> None:
    """DCP reshards the tp=2 shards (and their momentum) to whole tensors: steps 3-4 and the final
    parameters equal the uninterrupted tp=2 run (1e-5: TP's partial sums round differently)."""
    checkpoint, reference = uninterrupted_tp
    _, task = fit(compose_config(["strategy=ddp", "trainer.devices=1", *RUN]), tmp_path, ckpt_path=str(checkpoint))
    resumed, expected = step_losses(task.history), step_losses(reference)
    assert sorted(resumed) == [1, 2, 3, 4] and resumed[3] != resumed[2]
    for step in (3, 4):
        assert abs(resumed[step] - expected[step]) <= 1e-5, (step, resumed[step], expected[step])
    params, expected_params = final_params(task.history), final_params(reference)
    assert params.keys() == expected_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected_params[name], rtol=1e-5, atol=1e-5, msg=name)
