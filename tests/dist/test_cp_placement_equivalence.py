"""Hybrid cp placement (`strategies.context.placement`) trains the same steps as one process.

With ``strategy.context_parallel.placement=hybrid`` the rows of a cp group whose documents fit one
shard train whole on single cp ranks (like extra data parallelism) and the others are split over
the group; gradients still sum over dp x cp and the Task divides by the step's global supervised
tokens, so losses, gradients and parameters equal a plain one-process loop.

fp32, nano Llama, global batch 8 of 64-token rows, 5 steps of SGD with momentum. The corpus mixes
short documents (3 to 12 words) with one in ten of 20 to 60 words, so most steps have both whole
and split rows (asserted from the logged ``perf/cp_whole_rows``; the rows drawn depend on the
corpus path, which pytest varies: measured over 4 paths, every step but one had 2 whole rows of 4
per group). The reference is written here
(one forward of the 8 rows, loss = summed token CE / supervised tokens). Tolerance 1e-5.

FSDP 2 x CP 2 ring with document sharding runs in the default suite; CP 4 ring with full
activation checkpointing (a recompute of whole rows must attend whole again) is slow::

    timeout 1800 python -m pytest tests/dist/test_cp_placement_equivalence.py -m slow -q
"""

from __future__ import annotations

import json
import random

import pytest

from harness import EXACT_SGD, assert_equals_reference, compose_config, fit, reference_run

STEPS = 5
TOL = {"rtol": 1e-5, "atol": 1e-5}
COMMON = (
    *EXACT_SGD,
    f"trainer.max_steps={STEPS}",
    "strategy.context_parallel.placement=hybrid",
    "+callbacks.grads._target_=harness.GradRecorder",
    "+callbacks.params._target_=harness.ParamRecorder",
)
LAYOUTS = {
    "fsdp2_x_cp2_ring_document": pytest.param(
        ["strategy=nd", "strategy.dp_shard=2", "strategy.cp=2", "trainer.devices=4", "train.micro_batch_size=2",
         "strategy.context_parallel.sharding=document"],
        id="fsdp2_x_cp2_ring_document",
    ),
    "cp4_ring_checkpointed": pytest.param(
        ["strategy=cp", "strategy.context_parallel.mode=ring", "trainer.devices=4", "train.micro_batch_size=4",
         "strategy.activation_checkpoint.mode=full"],
        id="cp4_ring_checkpointed", marks=pytest.mark.slow,
    ),
}  # fmt: skip
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "mixed.jsonl"
    sizes = [rng.randint(20, 60) if rng.random() < 0.10 else rng.randint(3, 12) for _ in range(400)]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=k))}) + "\n" for k in sizes))
    return str(path)


@pytest.fixture(scope="module")
def ref(corpus) -> dict:
    """Plain PyTorch on one process: one forward of the step's 8 rows."""
    cfg = compose_config([*EXACT_SGD, f"data.path={corpus}"])
    return reference_run(cfg, STEPS)


@pytest.mark.parametrize("overrides", list(LAYOUTS.values()))
def test_hybrid_placement_equals_one_process(tmp_path, corpus, ref, overrides):
    cfg = compose_config([*COMMON, f"data.path={corpus}", *overrides])
    _, task = fit(cfg, tmp_path)
    whole = [h["perf/cp_whole_rows"] for h in task.history if "perf/cp_whole_rows" in h]
    rows_per_group = 8 // (2 if "strategy.dp_shard=2" in overrides else 1)
    assert sum(0 < w < rows_per_group for w in whole) >= 2, whole  # steps with whole and split rows
    assert_equals_reference(task.history, ref, STEPS, **TOL)
