"""Mixout (`strategies.transforms.mixout`): off at p=0, a sharded run equals an independent one-process
reference that mixes with autograd, and a resumed run continues exactly as the uninterrupted one.

fp32 nano Llama, the bundled corpus, global batch 8 of 64-token rows, 3 steps of SGD with momentum
(constant LR, no clipping). The reference is a plain PyTorch loop written here: each step it builds
``w_mixed = ((1 - M) w + M u - p u) / (1 - p)`` as a differentiable function of ``w`` and runs the
model on those tensors (``torch.func.functional_call``), so autograd gives ``w``'s gradient; plait
instead overwrites the shards in place and rescales the gradient after the backward. The masks
come from plait's `mixout_mask` (a random draw, shared on purpose: the reference checks the
mixing and its gradient, not the random numbers).

Resume: fine-tuning from a plain run's weights (``model.init_from``), 4 steps with a checkpoint at
step 2, against a run resumed from that checkpoint: its steps 3 and 4 must have bitwise the losses of
the uninterrupted run, which needs the anchors to be the ``init_from`` weights again (not the
step-2 weights the checkpoint restores) and the masks of steps 3 and 4 (not of steps 1 and 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from harness import EXACT_SGD, compose_config, fit, losses, reference_setup
from strategies.transforms.mixout import mixout_mask
from trainer.data.packing import IGNORE_INDEX

STEPS = 3
P = 0.3
TOL = {"rtol": 1e-6, "atol": 1e-6}
COMMON = (*EXACT_SGD, f"trainer.max_steps={STEPS}", "+callbacks.params._target_=harness.ParamRecorder")
MIXOUT = ("+strategy/mixout=default", "strategy.mixout.seed=3")


def _run(overrides: list[str], run_dir) -> dict:
    _, task = fit(compose_config([*COMMON, *overrides]), run_dir)
    return {"loss": losses(task.history), "params": [h["params"] for h in task.history if "params" in h][0]}


def _is_target(name: str, param: torch.Tensor) -> bool:
    return param.dim() >= 2 and ("attention." in name or "feed_forward." in name)


def reference(p: float) -> dict:
    cfg = compose_config([*COMMON, *MIXOUT])
    rows, model, optimizer, sampler = reference_setup(cfg)
    anchors = {n: w.detach().clone() for n, w in model.named_parameters()}
    out = {"loss": []}
    for step, index in zip(range(STEPS), sampler):
        mixed = {}
        for name, w in model.named_parameters():
            if _is_target(name, w):
                m = mixout_mask(w, p, seed=3, step=step, name=name).to(w.dtype)
                mixed[name] = ((1 - m) * w + m * anchors[name] - p * anchors[name]) / (1 - p)
            else:
                mixed[name] = w
        labels = rows.labels[index]
        kwargs = {"position_ids_bt": rows.position_ids[index], "document_ids_bt": rows.document_ids[index]}
        logits = functional_call(model, mixed, (rows.input_ids[index],), kwargs)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        out["loss"].append(loss.item())
        optimizer.step()
    out["params"] = {n: w.detach().clone() for n, w in model.named_parameters()}
    return out


def test_p0_trains_exactly_as_without_mixout(tmp_path):
    plain = _run(["train.micro_batch_size=4"], tmp_path / "plain")
    off = _run(["train.micro_batch_size=4", *MIXOUT, "strategy.mixout.p=0.0"], tmp_path / "p0")
    assert plain["loss"] == off["loss"]
    for name, w in plain["params"].items():
        assert torch.equal(w, off["params"][name]), name


@pytest.mark.parametrize("layout", [["train.micro_batch_size=8"], ["strategy=fsdp", "trainer.devices=2"]], ids=["one_process", "fsdp2"])
def test_mixout_equals_reference(tmp_path, layout):
    expected = reference(P)
    run = _run([*layout, *MIXOUT, f"strategy.mixout.p={P}"], tmp_path)
    torch.testing.assert_close(run["loss"], expected["loss"], **TOL)
    torch.testing.assert_close(run["params"], expected["params"], **TOL)


LAYOUTS = {"one_process": ["train.micro_batch_size=8"], "fsdp2": ["strategy=fsdp", "trainer.devices=2"]}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A plain 2-step run: the weights the Mixout runs fine-tune from (and mix with)."""
    run_dir = tmp_path_factory.mktemp("pretrained")
    fit(compose_config([*EXACT_SGD, "trainer.max_steps=2", "train.micro_batch_size=8"]), run_dir)
    return run_dir


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_resume_equals_the_uninterrupted_run(pretrained, tmp_path, layout):
    run = [
        "optim=sgd", "scheduler=constant", "scheduler.warmup_steps=0", "trainer.max_steps=4",
        "callbacks.checkpoint.every_n_steps=2", "callbacks.checkpoint.keep_last=0", f"model.init_from={pretrained}",
        *layout, *MIXOUT, f"strategy.mixout.p={P}",
    ]  # fmt: skip
    _, straight = fit(compose_config(run), tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_0000002"
    _, resumed = fit(compose_config(run), tmp_path / "resumed", ckpt_path=str(checkpoint))
    expected = {h["step"]: h["loss"] for h in straight.history if "loss" in h}
    got = {h["step"]: h["loss"] for h in resumed.history if "loss" in h}
    assert sorted(expected) == sorted(got) == [1, 2, 3, 4]  # the history before step 2 is restored
    assert [got[3], got[4]] == [expected[3], expected[4]]
