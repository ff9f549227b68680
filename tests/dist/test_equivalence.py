"""Every data-parallel and tensor-parallel layout and accumulation split equals one process on the
whole global batch.

fp32, nano Llama, global batch 8 of 64-token rows, 5 steps of SGD with momentum 0.9 (lr 0.1,
constant; no clipping, so every layout applies its own gradient). The data is a jsonl of short
documents: packed rows hold several end-of-document positions (label -100), so rows, micro-batches
and ranks have unequal supervised-token counts, and only a step normalised by the global count
matches (a mean of per-micro-batch or per-rank means does not). The reference is a plain PyTorch
loop written here: the same initial weights (``torch.manual_seed(cfg.seed)`` + the model config),
the same rows in the same global-batch order (``GlobalBatchSampler(dp_size=1)``), one forward of
all 8 rows, loss = summed token CE / supervised tokens of the step.

Each plait run (`Task` + `MeshStrategy` in forked gloo ranks) is compared with one process at
micro-batch 8 and with the reference: losses and gradients at each step, parameters after the 5
steps. Tolerances (``TOL``): rtol 1e-6 and atol 1e-6 for every layout, FSDP (also with CPU offload), HSDP, TP (with and
without sequence and loss parallel), FSDP x TP and PP x TP included (each pipeline schedule is
tested in test_pipeline.py); whole-model compile under FSDP2, and TP (with and without sequence and loss parallel) with
compiled blocks or the whole model, traced by aot_eager. The layouts compiled
by inductor (``COMPILED``, slow: a C++ build per graph) are compared with ``COMPILED_TOL``: inductor
fuses elementwise chains and reorders reductions, so a compiled step rounds differently.
Reported gradient norms agree to 1e-4 relative only: torch's fp32 ``vector_norm`` of a large CPU
tensor (the 4096 x 64 output head) is off by up to ~6e-5 relative, and FSDP takes the norm of
smaller shards, so the layouts round differently although their gradients are equal.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from harness import EXACT_SGD, compose_config, fit, losses, reference_setup

from trainer.build import build_data
from trainer.data.packing import IGNORE_INDEX

STEPS = 5
TOL = {"rtol": 1e-6, "atol": 1e-6}
COMMON = (
    *EXACT_SGD,
    f"trainer.max_steps={STEPS}",
    "+callbacks.grads._target_=harness.GradRecorder",
    "+callbacks.params._target_=harness.ParamRecorder",
)
_COMPILE_MODEL = ("strategy.compile.enabled=true", "strategy.compile.scope=model", "strategy.compile.backend=aot_eager")
_COMPILE_BLOCK = (_COMPILE_MODEL[0], _COMPILE_MODEL[2])  # the block scope (the default), aot_eager
_TP_OFF = ("strategy.tensor_parallel.sequence_parallel=false", "strategy.tensor_parallel.loss_parallel=false")
# id -> overrides. Global batch 8 = micro-batch x grad-accum x dp in each.
LAYOUTS = {
    "ga4_x_micro2": ["train.micro_batch_size=2"],
    "ddp2": ["strategy=ddp", "trainer.devices=2", "train.micro_batch_size=4"],
    "fsdp2_ga2": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"],
    # FSDP's CPUOffloadPolicy (pin_memory=False without a GPU): shards, gradients and optimizer state on CPU.
    "fsdp2_cpu_offload": [
        "strategy=fsdp",
        "trainer.devices=2",
        "train.micro_batch_size=2",
        "strategy.fsdp.cpu_offload=true",
        "+callbacks.offload._target_=harness.OffloadRecorder",
    ],  # fmt: skip
    "fsdp4": ["strategy=fsdp", "trainer.devices=4", "train.micro_batch_size=2"],
    "hsdp2x2_ga2": ["strategy=hsdp", "trainer.devices=4", "train.micro_batch_size=1"],
    # Tensor parallel: plain Megatron pairs, + sequence parallel, + loss parallel, and 2-D.
    "tp2": ["strategy=tp", "trainer.devices=2", *_TP_OFF],
    "tp2_sp": ["strategy=tp", "trainer.devices=2", *_TP_OFF[1:], "train.micro_batch_size=4"],
    "tp2_lp": ["strategy=tp", "trainer.devices=2", *_TP_OFF[:1]],
    "fsdp2_x_tp2_sp_lp": ["strategy=fsdp_tp", "trainer.devices=4", "train.micro_batch_size=2"],
    # Pipeline x tensor parallel: stages pass [B, T/tp, D] sequence-parallel hidden states.
    "pp2_x_tp2_sp_lp": [
        "strategy=nd",
        "strategy.pp=2",
        "strategy.tp=2",
        "strategy.dp_shard=1",
        "trainer.devices=4",
        "train.micro_batch_size=2",
    ],
    # Whole-model compile under FSDP2 (dynamo breaks the graph at each block's FSDP hooks). aot_eager
    # traces and partitions the graphs without generating code; inductor's layouts are in COMPILED.
    "fsdp2_compile_model": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2", *_COMPILE_MODEL],
    # Compiled tensor-parallel blocks (sequence and loss parallel): the row-wise embedding's output,
    # an AsyncCollectiveTensor, is made a plain tensor before the first compiled block.
    "tp2_sp_lp_compile_block": ["strategy=tp", "trainer.devices=2", *_COMPILE_BLOCK],
    "tp2_sp_lp_compile_model": ["strategy=tp", "trainer.devices=2", *_COMPILE_MODEL],
    "tp2_compile_block": ["strategy=tp", "trainer.devices=2", *_TP_OFF, *_COMPILE_BLOCK],
}
# Compiled blocks on the FSDP2 x TP 2 and PP 2 x TP 2 layouts above.
LAYOUTS |= {
    f"{base[:-6]}_compile_block": [*LAYOUTS[base], *_COMPILE_BLOCK] for base in ("fsdp2_x_tp2_sp_lp", "pp2_x_tp2_sp_lp")
}


WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """600 documents of 3 to 30 words: about one document end per 64-token row."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "short_docs.jsonl"
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))}) for _ in range(600)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _run(corpus: str, overrides: list[str], run_dir) -> dict:
    cfg = compose_config([*COMMON, f"data.path={corpus}", *overrides])
    _, task = fit(cfg, run_dir)
    return {
        "loss": losses(task.history),
        "grad_norm": [h["grad_norm"] for h in task.history if "loss" in h],
        "grads": [h["grads"] for h in task.history if "grads" in h],
        "params": [h["params"] for h in task.history if "params" in h][0],
        "offload": [h["offload"] for h in task.history if "offload" in h],
    }


def reference(corpus: str) -> dict:
    """Plain PyTorch on one process: one forward of the whole global batch per step."""
    cfg = compose_config([*COMMON, f"data.path={corpus}"])
    rows, model, optimizer, sampler = reference_setup(cfg)
    out = {"loss": [], "grad_norm": [], "grads": []}
    out["init"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _, index in zip(range(STEPS), sampler):
        labels = rows.labels[index]
        logits = model(
            rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
        )
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["loss"].append(loss.item())
        out["grad_norm"].append(torch.stack([g.double().norm() for g in grads.values()]).norm().item())
        out["grads"].append(grads)
        optimizer.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def ref(corpus) -> dict:
    return reference(corpus)


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory) -> dict:
    """plait on one process, micro-batch 8: the whole global batch in one forward."""
    return _run(corpus, ["train.micro_batch_size=8"], tmp_path_factory.mktemp("one_process"))


def assert_equivalent(run: dict, expected: dict) -> None:
    assert len(run["loss"]) == len(run["grads"]) == STEPS
    for step in range(STEPS):
        torch.testing.assert_close(run["loss"][step], expected["loss"][step], **TOL, msg=f"loss at step {step + 1}")
        torch.testing.assert_close(run["grads"][step], expected["grads"][step], **TOL, msg=f"grads at step {step + 1}")
    assert run["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    torch.testing.assert_close(run["params"], expected["params"], **TOL, msg=f"parameters after {STEPS} SGD steps")


def test_supervised_counts_differ_between_micro_batches(corpus):
    prepared = build_data(compose_config([*COMMON, f"data.path={corpus}"])).prepare()
    counts = (prepared.train.labels[: 3 * 8] != IGNORE_INDEX).sum(dim=1)
    assert len(set(counts.tolist())) > 1 and counts.max() < 64


def test_one_process_equals_reference_loop(one_process, ref):
    assert_equivalent(one_process, ref)
    # The run trains: the steps see different rows and every parameter moves.
    assert len(set(ref["loss"])) == STEPS
    assert all(not torch.equal(one_process["params"][n], p) for n, p in ref["init"].items())


# The suite's budget (13-23 s each on 2 cores): -m slow runs them. Each compile scope keeps a layout in the
# default run (block: tp2_sp_lp_compile_block and tp2_compile_block; model: fsdp2_compile_model).
SLOW = {"fsdp2_x_tp2_compile_block", "pp2_x_tp2_compile_block", "tp2_sp_lp_compile_model"}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in LAYOUTS],
    ids=list(LAYOUTS),
)
def test_layout_equals_one_process(tmp_path, corpus, layout, one_process, ref):
    run = _run(corpus, LAYOUTS[layout], tmp_path)
    if layout == "fsdp2_cpu_offload":  # the policy is in effect on every sharded module
        assert run["offload"] == [["CPUOffloadPolicy(pin_memory=False)"]]
    assert_equivalent(run, one_process)
    assert_equivalent(run, ref)


COMPILED_TOL = {"rtol": 1e-4, "atol": 1e-5}
_INDUCTOR = ("strategy.compile.enabled=true", "strategy.compile.backend=inductor")
COMPILED = {
    "one_process_block": ["train.micro_batch_size=8", *_INDUCTOR],
    "one_process_model": ["train.micro_batch_size=8", *_INDUCTOR, "strategy.compile.scope=model"],
    "fsdp2_model": [
        "strategy=fsdp",
        "trainer.devices=2",
        "train.micro_batch_size=4",
        *_INDUCTOR,
        "strategy.compile.scope=model",
    ],
    "tp2_sp_lp_block": ["strategy=tp", "trainer.devices=2", *_INDUCTOR],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(COMPILED), ids=list(COMPILED))
def test_compiled_layout_equals_reference(tmp_path, corpus, layout, ref):
    run = _run(corpus, COMPILED[layout], tmp_path)
    assert len(run["loss"]) == STEPS
    for step in range(STEPS):
        torch.testing.assert_close(run["loss"][step], ref["loss"][step], **COMPILED_TOL, msg=f"loss at step {step + 1}")
        torch.testing.assert_close(
            run["grads"][step], ref["grads"][step], **COMPILED_TOL, msg=f"grads at step {step + 1}"
        )
    torch.testing.assert_close(run["params"], ref["params"], **COMPILED_TOL, msg=f"parameters after {STEPS} SGD steps")
