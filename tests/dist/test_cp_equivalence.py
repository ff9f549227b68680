"""Context-parallel training equals one process: loss per step and parameters after 5 SGD-momentum steps.

fp32, nano Llama (GQA 4/2 heads), global batch 8 of 64-token packed rows from short documents
(several document ends per row, so documents straddle the cp shards and the shards have unequal
supervised-token counts). The reference is a plain PyTorch loop over the same rows (one forward of
the whole global batch per step, loss = summed CE / supervised tokens), as in test_equivalence.py.
Tolerance 1e-5 (absolute and relative). Layouts: FSDP2 x CP2 ring on 4 processes (with grad
accumulation 2 and the chunked cross-entropy, whose LM head is FSDP's root parameter), CP2 Ulysses
with the chunked cross-entropy, CP4 hybrid (2 head groups x ring of
2) with activation checkpointing and chunked score blocks, CP2 x TP2 with compiled blocks (aot_eager).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from harness import EXACT_SGD, compose_config, fit, losses, reference_setup

from trainer.data.packing import IGNORE_INDEX

STEPS = 5
TOL = {"rtol": 1e-5, "atol": 1e-5}
COMMON = (
    *EXACT_SGD,
    f"trainer.max_steps={STEPS}",
    "+callbacks.params._target_=harness.ParamRecorder",
)
LAYOUTS = {
    "fsdp2_x_cp2_ring_chunked_ce": [
        "strategy=nd", "strategy.dp_shard=2", "strategy.cp=2", "trainer.devices=4", "train.micro_batch_size=2",
        "objective.loss_chunk_tokens=40",
    ],
    "cp2_ulysses_chunked_ce": [
        "strategy=cp", "strategy.context_parallel.mode=ulysses", "trainer.devices=2", "objective.loss_chunk_tokens=48",
    ],
    # Compiled blocks (aot_eager) on a CP x TP mesh: the context-parallel attention inside
    # tensor-parallel blocks, the row-wise embedding's output made a plain tensor before them.
    "cp2_x_tp2_compile_block": [
        "strategy=nd", "strategy.cp=2", "strategy.tp=2", "strategy.dp_shard=1", "trainer.devices=4",
        "strategy.compile.enabled=true", "strategy.compile.backend=aot_eager",
    ],
    "cp4_hybrid_checkpointed": [
        "strategy=cp", "strategy.context_parallel.mode=hybrid", "trainer.devices=4", "strategy.activation_checkpoint.mode=full",
        "strategy.context_parallel.kv_chunk=8",
    ],
}  # fmt: skip
WORDS = "shall i compare thee to a summer's day thou art more lovely and temperate".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("cp_corpus") / "docs.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 25)))}) for _ in range(400))
    )
    return str(path)


@pytest.fixture(scope="module")
def reference(corpus) -> dict:
    """Plain PyTorch on one process, one forward of the global batch per step."""
    cfg = compose_config([*COMMON, f"data.path={corpus}"])
    rows, model, optimizer, sampler = reference_setup(cfg)
    loss_per_step, docs_per_row = [], []
    for _, index in zip(range(STEPS), sampler):
        labels = rows.labels[index]
        docs_per_row.append(int(rows.document_ids[index].max(dim=1).values.min()) + 1)
        logits = model(
            rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
        )
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_per_step.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss_per_step, "params": params, "min_docs_per_row": min(docs_per_row)}


def test_rows_are_packed(reference):
    assert reference["min_docs_per_row"] >= 2  # every row holds several documents (boundaries fall inside shards)


# The suite's budget: compiled CP x TP takes ~35 s on 2 cores (compile x CP and x TP each run by default
# elsewhere: tests/dist/test_equivalence.py -k compile); `python -m pytest -m slow` runs it.
SLOW = {"cp2_x_tp2_compile_block"}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in LAYOUTS],
    ids=list(LAYOUTS),
)
def test_context_parallel_training_equals_one_process(tmp_path, corpus, reference, layout):
    cfg = compose_config([*COMMON, f"data.path={corpus}", *LAYOUTS[layout]])
    _, task = fit(cfg, tmp_path)
    (params,) = [h["params"] for h in task.history if "params" in h]
    torch.testing.assert_close(losses(task.history), reference["loss"], **TOL)
    torch.testing.assert_close(params, reference["params"], **TOL)


# Document-aware sharding (strategies.context.document_shards): every document of a row zigzagged on its own.
_DOC = "strategy.context_parallel.sharding=document"
DOCUMENT_LAYOUTS = {
    "cp2_ring_document": ["strategy=cp", "strategy.context_parallel.mode=ring", "trainer.devices=2", _DOC],
    "cp2_ulysses_document": ["strategy=cp", "strategy.context_parallel.mode=ulysses", "trainer.devices=2", _DOC],
    "cp4_hybrid_document": pytest.param(
        [
            "strategy=cp",
            "strategy.context_parallel.mode=hybrid",
            "trainer.devices=4",
            "strategy.context_parallel.kv_chunk=8",
            _DOC,
        ],
        marks=pytest.mark.slow,
    ),
}


@pytest.mark.parametrize("overrides", list(DOCUMENT_LAYOUTS.values()), ids=list(DOCUMENT_LAYOUTS))
def test_document_sharding_equals_one_process(tmp_path, corpus, reference, overrides):
    cfg = compose_config([*COMMON, f"data.path={corpus}", *overrides])
    _, task = fit(cfg, tmp_path)
    (params,) = [h["params"] for h in task.history if "params" in h]
    torch.testing.assert_close(losses(task.history), reference["loss"], **TOL)
    torch.testing.assert_close(params, reference["params"], **TOL)
