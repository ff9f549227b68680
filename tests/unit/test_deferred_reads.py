"""The step's values stay on the device between logging steps: no host read (``.item()``,
``.tolist()``, a tensor in an ``if``) inside a training step that neither logs nor evaluates; the
history read later equals the one read every step; a fused optimizer skips a non-finite step on
the device, exactly like a plain loop that leaves that step out."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import compose_config, fit
from torch.overrides import TorchFunctionMode

from trainer.step_metrics import NamedMeans, PendingSteps
from trainer.task import Task

HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"}
# The CPU attention groups documents by length from the ids (host numbers); CUDA builds a
# FlexAttention block mask on the device instead (`trainer.models.attention.Attention.mask`).
CPU_ATTENTION = "trainer/models/document_masks.py"
IGNORE_INDEX = -100


class _HostReads(TorchFunctionMode):
    """Counts the tensor methods that read a value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in HOST_READS:
            import traceback

            frame = traceback.extract_stack(limit=2)[0]
            if not frame.filename.endswith(CPU_ATTENTION):
                self.reads.append(f"{func.__name__} {frame.filename}:{frame.lineno}")
        return func(*args, **(kwargs or {}))


def _counting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wraps `Task.training_step` (the forked ranks inherit it): each step's host reads go into
    the history as ``{"reads_of_step": k, "reads": n}``."""
    step = Task.training_step

    def counted(self: Task, batch: Any, batch_idx: int) -> None:
        with _HostReads() as mode:
            step(self, batch, batch_idx)
        self._history.append({"reads_of_step": self.global_step, "reads": len(mode.reads), "where": mode.reads})

    monkeypatch.setattr(Task, "training_step", counted)


def test_only_logging_and_evaluation_steps_read_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _counting(monkeypatch)
    common = ["trainer.max_steps=6", "train.eval_every=5", "logger=csv"]
    _, task = fit(compose_config([*common, "trainer.log_every_n_steps=3"]), tmp_path / "every3")
    reads = {h["reads_of_step"]: h["reads"] for h in task.history if "reads_of_step" in h}
    assert [s for s, n in reads.items() if n] == [3, 5, 6], [h["where"] for h in task.history if "where" in h][
        :2
    ]  # log (3), evaluate (5), last (6)
    _, every_step = fit(compose_config([*common, "trainer.log_every_n_steps=1"]), tmp_path / "every1")
    steps = lambda t: [{k: v for k, v in h.items()} for h in t.history if "loss" in h]  # noqa: E731
    assert steps(task) == steps(every_step)  # the same floats, read later
    with open(tmp_path / "every3" / "metrics.csv", newline="") as file:
        logged = {int(r["step"]): r["train/loss"] for r in csv.DictReader(file) if r.get("train/loss")}
    assert sorted(logged) == [3, 6] and float(logged[6]) == steps(task)[-1]["loss"]


def test_pending_steps_read_in_one_transfer_and_keep_integers() -> None:
    pending = PendingSteps()
    sums = torch.tensor([[3.0, 5.0, 1.0], [2.0, 0.0, 4.0]])
    pending.add(
        {"step": 1, "loss": torch.tensor(2.5), "tokens": torch.tensor(2**40 + 1)},
        [NamedMeans.of_sums("train", ["a", "b", "c"], sums)],
    )
    pending.add({"step": 2, "loss": torch.tensor(math.nan), "lr": 0.5})
    with _HostReads() as mode:
        first, second = pending.read()
    assert [r.split()[0] for r in mode.reads] == ["tolist"] and len(pending) == 0
    assert first == {"step": 1, "loss": 2.5, "tokens": 2**40 + 1, "train/a": 1.5, "train/c": 0.25}  # count 0: left out
    assert (
        isinstance(first["tokens"], int) and second["step"] == 2 and math.isnan(second["loss"]) and second["lr"] == 0.5
    )


POISONED, STEPS = 2, 3


class Poison:
    """During optimizer step ``POISONED`` one output weight is NaN; restored after that step."""

    def __new__(cls) -> Any:
        from test_nonfinite_steps import Poison as Plain  # the callback of the host-read path's test

        return Plain()


def _adamw_reference(cfg: Any) -> dict[str, torch.Tensor]:
    """Plain PyTorch AdamW (torch's per-tensor loop, not fused): steps 1 and 3; step 2's batch is
    drawn but the optimizer never sees it (no update, no moment, no step count)."""
    from trainer.build import build_data
    from trainer.data.sampler import GlobalBatchSampler
    from trainer.model_node import instantiate_model

    rows = build_data(cfg).prepare()
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model, vocab_size=rows.tokenizer.vocab_size)
    rows = rows.train
    sampler = GlobalBatchSampler(
        len(rows),
        global_batch_size=cfg.train.global_batch_size,
        dp_size=1,
        shuffle=cfg.data.shuffle,
        seed=cfg.data.seed,
        drop_last=cfg.data.drop_last,
    )
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=0.0,
        foreach=False,
    )
    for step, index in zip(range(1, STEPS + 1), sampler):
        if step == POISONED:
            continue
        logits = model(
            rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
        )
        labels = rows.labels[index]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss / (labels != IGNORE_INDEX).sum()).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_fused_optimizer_skips_a_non_finite_step_on_the_device(tmp_path: Path) -> None:
    cfg = compose_config([
        "optim=adamw", "optim.fused=true", "optim.weight_decay=0", "scheduler=constant", "scheduler.warmup_steps=0",
        "train.max_grad_norm=0", f"trainer.max_steps={STEPS}", f"trainer.log_every_n_steps={STEPS}",
        "train.micro_batch_size=8", "train.nonfinite=skip", "logger=csv",
        "+callbacks.poison._target_=test_nonfinite_steps.Poison", "+callbacks.params._target_=harness.ParamRecorder",
    ])  # fmt: skip
    _, task = fit(cfg, tmp_path)
    losses = [h["loss"] for h in task.history if "loss" in h]
    assert math.isnan(losses[POISONED - 1]) and math.isfinite(losses[0]) and math.isfinite(losses[2])
    params = next(h["params"] for h in task.history if "params" in h)
    torch.testing.assert_close(params, _adamw_reference(cfg), rtol=1e-5, atol=1e-6)
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [r["train/nonfinite_steps"] for r in rows if r["step"] == str(STEPS)] == ["1.0"]
