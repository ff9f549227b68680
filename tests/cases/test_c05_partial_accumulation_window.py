"""Case C05 — the last, partial accumulation window of an epoch is scaled by the configured GA
(Lightning-AI/pytorch-lightning#19987; pytorch/torchtune#2745; huggingface/transformers#22098).

Scenario: 10 micro-batches per epoch, GA=4, so the windows are 4, 4, 2. Every micro-batch has the
same mean-loss gradient g.
Expected: 3 optimizer steps per epoch, each applying gradient g: the last window is normalised by
its own token count (the fault applies 0.5 g there). Leftover micro-batches do not leak into the
next epoch: the first step of epoch 2 accumulates 4 micro-batches, not 6.

plait's Task + strategy (1 process, and DDP on 2 gloo ranks) with ``data.drop_last=false`` on 10
one-row micro-batches (`FixedRowsData`, tests/cases/controlled.py). Row i holds 4 supervised
copies of its own token i+1, all tokens with CE 1.0 in a `TableLM`: every row's mean-loss gradient
is the same vector g on its own table row. So the step gradient summed over table rows must be g
in every window, and the step gradient itself must be the mean over exactly the rows of that
window (what the sampler gives, no row of another window). SGD with lr 0 keeps the table fixed, so
g is the same at every step.
"""

from __future__ import annotations

import pytest
import torch
from controlled import TableLM, data_overrides, row, rows_from, table_overrides, token_ce
from harness import compose_config, fit

from trainer.data.packing import IGNORE_INDEX
from trainer.data.sampler import GlobalBatchSampler

NUM_ROWS, SEQ_LEN, GA, SEED = 10, 8, 4, 0


def rows():
    made = [row([i + 1] * 4, SEQ_LEN) for i in range(NUM_ROWS)]
    return rows_from([r[0] for r in made], [r[1] for r in made])


def mean_gradient(row_ids: list[int]) -> torch.Tensor:
    """Gradient of (summed token CE over ``row_ids``) / (their supervised tokens): one big batch."""
    model = TableLM(vocab_size=16)
    data = rows()
    window = rows_from(data.input_ids[row_ids].tolist(), data.labels[row_ids].tolist())
    (token_ce(model, window).sum() / (window.labels != IGNORE_INDEX).sum()).backward()
    return model.layers[0].weight.grad


def expected_windows() -> list[list[int]]:
    """Rows of each optimizer step over 2 epochs, from the world-size-independent global order."""
    sampler = GlobalBatchSampler(NUM_ROWS, global_batch_size=GA, shuffle=True, seed=SEED, drop_last=False)
    windows = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        windows += list(sampler)
    return windows


@pytest.fixture(scope="module")
def g():
    return mean_gradient([0]).sum(dim=0)  # every row alone gives this, on its own table row


@pytest.mark.parametrize("devices", [1, 2], ids=["one_process", "ddp2"])
def test_partial_window_applies_full_gradient_and_does_not_leak(tmp_path, devices, g):
    cfg = compose_config(
        [
            *table_overrides([]),
            *data_overrides("test_c05_partial_accumulation_window.rows", seq_len=SEQ_LEN),
            "data.drop_last=false",
            "data.shuffle=true",
            f"seed={SEED}",
            f"train.global_batch_size={GA}",
            "train.micro_batch_size=1",
            "train.max_grad_norm=0",
            "optim=sgd",
            "optim.lr=0.0",
            "scheduler=constant",
            "scheduler.warmup_steps=0",
            "trainer.max_steps=6",
            f"trainer.devices={devices}",
            "+callbacks.grads._target_=harness.GradRecorder",
            "+callbacks.forwards._target_=controlled.ForwardCounter",
        ]
    )
    _, task = fit(cfg, tmp_path)
    steps = [h for h in task.history if "forwards" in h]
    grads = [h["grads"]["layers.0.weight"] for h in task.history if "grads" in h]
    windows = expected_windows()
    assert [len(w) for w in windows] == [4, 4, 2, 4, 4, 2]
    assert sorted(windows[3] + windows[4] + windows[5]) == list(range(NUM_ROWS))

    # 3 optimizer steps per epoch; micro-batches per step on this rank: 4, 4, 2 (split over ranks).
    assert [h["epoch"] for h in steps] == [0, 0, 0, 1, 1, 1]
    assert [h["forwards"] for h in steps] == [len(w) // devices for w in windows]
    assert len(grads) == 6
    for k, (grad, window) in enumerate(zip(grads, windows), start=1):
        # The full gradient g in every window, the partial one included (the fault gives 0.5 g).
        torch.testing.assert_close(grad.sum(dim=0), g, rtol=1e-6, atol=1e-7, msg=f"step {k}")
        # Exactly the rows of this window, each weighted by its tokens: nothing carried over.
        torch.testing.assert_close(grad, mean_gradient(window), rtol=1e-6, atol=1e-7, msg=f"step {k}")
