"""Distributed Muon (`strategies.muon`): FSDP2 on 2 ranks and tensor parallelism (tp=2) equal one
process, and its state is checkpointed and resharded by DCP like AdamW's.

nano Llama, fp32, global batch 8 of 64-token rows, 4 steps of ``optim=muon`` at a constant LR
without clipping, Newton-Schulz in fp32 (``optim.ns_dtype=float32``: the iteration is then the
same arithmetic on every layout; only the gradients differ, by the layouts' reduction order).
Under FSDP2 the hidden matrices are Shard(0) over dp_shard, under tp Shard(0) / Shard(1) over tp:
each rank orthogonalises the whole matrices it owns and returns the others their shards.
Tolerance 1e-5 (test_equivalence.py's 1e-6 for SGD, x10: the orthogonalisation's normalisation
and Adam's 1/sqrt(v) magnify the gradients' last-bit differences).

FSDP2 x tp on 4 ranks (2 x 2) too: there the matrices are sharded over two mesh axes.

Resume: the FSDP2 run checkpoints at step 2; resumed on 2 ranks it continues bitwise as the
uninterrupted run (Muon's momentum and AdamW's moments restored), resumed on 1 rank (DCP
reshards the state) it continues within the tolerance. About a minute on 2 CPU cores: marked slow
(test_muon_step.py checks the same layouts below the trainer in seconds, in the default run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import compose_config, fit

pytestmark = pytest.mark.slow

STEPS = 4
TOL = {"rtol": 1e-5, "atol": 1e-5}
RUN = (
    "optim=muon",
    "optim.ns_dtype=float32",
    "scheduler=constant",
    "scheduler.warmup_steps=0",
    "train.max_grad_norm=0",
    f"trainer.max_steps={STEPS}",
    "callbacks.checkpoint.every_n_steps=2",
    "callbacks.checkpoint.keep_last=0",
    "+callbacks.params._target_=harness.ParamRecorder",
)
_TP_OFF = ("strategy.tensor_parallel.sequence_parallel=false", "strategy.tensor_parallel.loss_parallel=false")


def _fit(overrides: list[str], run_dir: Path, ckpt_path: str | None = None) -> dict[str, Any]:
    _, task = fit(compose_config([*RUN, *overrides]), run_dir, ckpt_path=ckpt_path)
    return {
        "loss": {h["step"]: h["loss"] for h in task.history if "loss" in h},
        "params": [h["params"] for h in task.history if "params" in h][-1],
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _fit(["train.micro_batch_size=8"], tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("fsdp2")
    run = _fit(["strategy=fsdp", "trainer.devices=2"], run_dir)
    return {**run, "checkpoint": run_dir / "checkpoints" / "step_0000002"}


def assert_close_runs(run: dict[str, Any], expected: dict[str, Any], **tol: float) -> None:
    assert sorted(run["loss"]) == sorted(expected["loss"]) == list(range(1, STEPS + 1))
    for step, loss in expected["loss"].items():
        torch.testing.assert_close(run["loss"][step], loss, **tol, msg=f"loss at step {step}")
    torch.testing.assert_close(run["params"], expected["params"], **tol, msg=f"parameters after {STEPS} steps")


def test_fsdp2_equals_one_process(fsdp2, one_process) -> None:
    assert_close_runs(fsdp2, one_process, **TOL)
    assert len(set(one_process["loss"].values())) == STEPS  # it trains


def test_tp2_equals_one_process(tmp_path: Path, one_process) -> None:
    assert_close_runs(_fit(["strategy=tp", "trainer.devices=2", *_TP_OFF], tmp_path), one_process, **TOL)


def test_fsdp2_x_tp2_equals_one_process(tmp_path: Path, one_process) -> None:
    """4 ranks: the matrices sharded over dp_shard and tp go through DTensor's re-sharding."""
    run = _fit(["strategy=fsdp_tp", "trainer.devices=4", "train.micro_batch_size=2"], tmp_path)
    assert_close_runs(run, one_process, **TOL)


def test_fsdp2_resume_is_bit_exact(tmp_path: Path, fsdp2) -> None:
    resumed = _fit(["strategy=fsdp", "trainer.devices=2"], tmp_path, ckpt_path=str(fsdp2["checkpoint"]))
    assert_close_runs(resumed, fsdp2, rtol=0, atol=0)


def test_fsdp2_checkpoint_resumes_on_one_process(tmp_path: Path, fsdp2) -> None:
    resumed = _fit(["train.micro_batch_size=8"], tmp_path, ckpt_path=str(fsdp2["checkpoint"]))
    assert_close_runs(resumed, fsdp2, **TOL)
