"""Resharding resume of expert parallelism: a checkpoint of EP2 x FSDP2 (4 ranks: the experts
sharded over ep=2 and FSDP'd over 2, the rest FSDP'd over 4) resumes at ep=1 (one process) and at
ep=4, and the run continues as the uninterrupted one (losses within 1e-6, parameters after it).

DCP holds the stacked expert weights as global [E, out, in] tensors whatever the ep, and the
expert biases as buffers; SGD with momentum makes step 4 depend on the resharded optimizer state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness import MOE_SMALL, compose_config, fit

pytestmark = pytest.mark.slow  # the suite's budget: run with -m slow

RUN = (
    *MOE_SMALL, "optim=sgd", "trainer.max_steps=4", "train.micro_batch_size=1", "callbacks.checkpoint.every_n_steps=2",
    "callbacks.checkpoint.keep_last=0", "+callbacks.params._target_=harness.ParamRecorder",
)


def step_losses(history: list[dict[str, Any]]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def final_params(history: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return [h["params"] for h in history if "params" in h][-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path_factory.mktemp("ep2_fsdp2")
    _, task = fit(compose_config(["strategy=nd", "trainer.devices=4", "strategy.expert_parallel.ep=2", *RUN]), run_dir)
    return run_dir / "checkpoints" / "step_0000002", task.history


@pytest.mark.parametrize(
    "layout",
    [("strategy=ddp", "trainer.devices=1"), ("strategy=nd", "trainer.devices=4", "strategy.expert_parallel.ep=4")],
    ids=["ep1_world1", "ep4_world4"],
)
def test_expert_parallel_checkpoint_resumes_at_another_ep(uninterrupted, layout: tuple[str, ...], tmp_path: Path) -> None:
    checkpoint, reference = uninterrupted
    _, task = fit(compose_config([*layout, *RUN]), tmp_path, ckpt_path=str(checkpoint))
    resumed, expected = step_losses(task.history), step_losses(reference)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - expected[step]) <= 1e-6, (step, resumed[step], expected[step])
    assert resumed[3] != resumed[2]
    params, expected_params = final_params(task.history), final_params(reference)
    assert params.keys() == expected_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected_params[name], rtol=1e-5, atol=1e-6, msg=name)
