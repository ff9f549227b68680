"""Case C09 — RNG state is not restored when resuming at an epoch boundary
(huggingface/transformers#17032).

Scenario: tiny model with dropout p=0.5 on CPU with deterministic algorithms, 2 epochs x 4 steps.
Save at the end of epoch 1 and resume for epoch 2.
Expected: the epoch-2 per-step losses are bitwise equal to the uninterrupted run, and the first
``torch.rand(())`` drawn after resume equals the uninterrupted value at the same point. The
checkpoint holds, per rank, the Python, NumPy, torch CPU and CUDA RNG states plus the sampler's
epoch seed.

plait's Task, MeshStrategy (DDP on 2 gloo ranks: each rank draws its own dropout masks) and
PeriodicCheckpoint (``every_n_steps=4``: a DCP checkpoint at the end of epoch 1) train `DropoutLM`
on 16 shuffled rows (`FixedRowsData`, 4 global batches of 4 per epoch). The uninterrupted run
goes on to step 8; a second fit resumes from its step-4 checkpoint. `RngProbe` gives every rank its own
seed and draws from every generator at the first batch of epoch 2 in both runs.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from controlled import data_overrides, rows_from
from harness import compose_config, fit
from torch import nn
from typing_extensions import override

SEQ_LEN, VOCAB, NUM_ROWS, STEPS_PER_EPOCH = 16, 16, 16, 4


def rows():
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(1, VOCAB, (NUM_ROWS, SEQ_LEN + 1), generator=generator)
    return rows_from(tokens[:, :-1].tolist(), tokens[:, 1:].tolist())


class DropoutLM(nn.Module):
    """Embedding -> one residual block with dropout p -> output head (plait's model signature)."""

    def __init__(self, *, vocab_size: int, dim: int = 16, p: float = 0.5, max_seq_len: int = SEQ_LEN) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(p))])
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(
        self,
        input_ids_bt: torch.Tensor,
        *,
        position_ids_bt: torch.Tensor | None = None,
        document_ids_bt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.tok_embeddings(input_ids_bt)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(h)


class RngProbe(L.Callback):
    """Seeds each rank differently at setup (before a checkpoint is restored); at the first batch of
    epoch 2, appends a draw from the torch, Python and NumPy generators."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        # Forked ranks inherit one RNG state; distinct streams make the per-rank restore matter
        # (rank 1 restored with rank 0's state would draw other dropout masks).
        seed = 100 + trainer.global_rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == STEPS_PER_EPOCH:
            draws = {"torch": torch.rand(()).item(), "python": random.random(), "numpy": float(np.random.rand())}
            pl_module.history.append({"step": trainer.global_step, "epoch": trainer.current_epoch, "rng": draws})


def _cfg(max_steps: int):
    return compose_config(
        [
            "~model",
            "+model._target_=test_c09_rng_restore.DropoutLM",
            *data_overrides("test_c09_rng_restore.rows", seq_len=SEQ_LEN),
            "data.shuffle=true",
            f"train.global_batch_size={NUM_ROWS // STEPS_PER_EPOCH}",
            "train.micro_batch_size=1",
            "optim=sgd",
            "scheduler=constant",
            "scheduler.warmup_steps=0",
            f"trainer.max_steps={max_steps}",
            "trainer.devices=2",
            "trainer.deterministic=true",
            f"callbacks.checkpoint.every_n_steps={STEPS_PER_EPOCH}",
            "callbacks.checkpoint.keep_last=0",
            "+callbacks.rng._target_=test_c09_rng_restore.RngProbe",
        ]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("c09")
    _, straight = fit(_cfg(2 * STEPS_PER_EPOCH), tmp / "straight")
    checkpoint = tmp / "straight" / "checkpoints" / f"step_{STEPS_PER_EPOCH:07d}"
    assert checkpoint.is_dir()
    _, resumed = fit(_cfg(2 * STEPS_PER_EPOCH), tmp / "resumed", ckpt_path=str(checkpoint))
    return straight.history, resumed.history, checkpoint


def _epoch2_losses(history: list[dict]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h and h["step"] > STEPS_PER_EPOCH}


def test_epoch2_losses_bitwise_equal(runs):
    straight, resumed = _epoch2_losses(runs[0]), _epoch2_losses(runs[1])
    assert sorted(straight) == list(range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1))  # steps 5..8
    assert resumed == straight  # float equality: bitwise
    assert len(set(straight.values())) == STEPS_PER_EPOCH  # four different steps, not one value


def test_first_draws_after_resume_equal_uninterrupted(runs):
    (straight,) = [h for h in runs[0] if "rng" in h]
    (resumed,) = [h for h in runs[1] if "rng" in h]
    assert straight["epoch"] == resumed["epoch"] == 1
    assert resumed["rng"] == straight["rng"]


def test_checkpoint_holds_per_rank_rng_and_the_sampler_position(runs):
    checkpoint = runs[2]
    states = [torch.load(checkpoint / "rng" / f"rank_{r:05d}.pt", weights_only=False) for r in range(2)]
    for state in states:
        assert {"python", "numpy", "torch"} <= state.keys()
    assert not torch.equal(states[0]["torch"], states[1]["torch"])  # each rank its own stream
    meta = torch.load(checkpoint / "meta.pt", weights_only=False)
    loader_states = meta["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_states == [{"epoch": 0, "trained": STEPS_PER_EPOCH}]


def test_dropout_masks_differ_between_steps():
    model = DropoutLM(vocab_size=VOCAB).train()
    ids = rows().input_ids[:2]
    assert not torch.equal(model(ids), model(ids))
