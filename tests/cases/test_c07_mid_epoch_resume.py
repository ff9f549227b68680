"""Case C07 — resuming from a mid-epoch checkpoint replays the epoch from the start
(Lightning-AI/pytorch-lightning#1182).

Scenario: 10 samples, batch size 1, shuffled with a fixed seed (permutation ``order``).
Checkpoint after 4 batches, kill the run, resume.
Expected: the resumed run processes exactly ``order[4:10]`` (6 batches) and then starts epoch 2;
every sample is seen once per epoch and ``global_step`` continues from 4.

Both batch streams of the one loader are checked: pretraining's fixed rows (10 rows, epoch = one permutation) and
the SFT mixture packed on the fly (one source of 10 single-row conversations, ``max_epochs=2``: epoch k of
the source is a permutation of its 10 samples; the run ends when the budget is spent).
"""

from __future__ import annotations

import json
from typing import Any

import lightning as L
from controlled import data_overrides, rows_from
from harness import TINY, compose_config, fit
from typing_extensions import override

NUM, SEQ_LEN, CKPT_STEP = 10, 8, 4


def rows():
    # Row i is recognisable by its first token, i + 1.
    tokens = [[i + 1] + [(i * 7 + t) % 15 + 1 for t in range(SEQ_LEN)] for i in range(NUM)]
    return rows_from([t[:-1] for t in tokens], [t[1:] for t in tokens])


class BatchRecorder(L.Callback):
    """Appends ``{"step", "epoch", "batch": first token of every row (0s and pads dropped)}``."""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        ids = batch["input_ids"]
        key = tuple(ids[:, 0].tolist()) if "source_ids" not in batch else tuple(ids.flatten().tolist())
        pl_module.history.append({"step": trainer.global_step, "epoch": trainer.current_epoch, "batch": key})


def _batches(history: list[dict]) -> list[tuple[int, int, tuple]]:
    return [(h["step"], h["epoch"], h["batch"]) for h in history if "batch" in h]


def _common(max_steps: int) -> list[str]:
    return [
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        f"trainer.max_steps={max_steps}",
        f"callbacks.checkpoint.every_n_steps={CKPT_STEP}",
        "callbacks.checkpoint.keep_last=0",
        "+callbacks.batches._target_=test_c07_mid_epoch_resume.BatchRecorder",
    ]


def _straight_and_resumed(cfg, tmp_path):
    _, straight = fit(cfg, tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoints" / f"step_{CKPT_STEP:07d}"
    _, resumed = fit(cfg, tmp_path / "resumed", ckpt_path=str(checkpoint))
    # The restored history holds the steps before the checkpoint: keep the new ones.
    return _batches(straight.history), [b for b in _batches(resumed.history) if b[0] > CKPT_STEP]


def test_pretraining_loader_resumes_mid_epoch(tmp_path):
    cfg = compose_config(
        [*data_overrides("test_c07_mid_epoch_resume.rows", seq_len=SEQ_LEN), "data.shuffle=true", *_common(NUM + 4)]
    )
    straight, resumed = _straight_and_resumed(cfg, tmp_path)
    order = [b[0] - 1 for _, e, b in straight if e == 0]
    assert sorted(order) == list(range(NUM))  # epoch 1: every sample once
    # The resumed run: steps 5..10 are order[4:10] in epoch 1, then epoch 2 begins at step 11.
    assert [s for s, _, _ in resumed] == list(range(CKPT_STEP + 1, NUM + 5))
    assert [b[0] - 1 for s, e, b in resumed if e == 0] == order[CKPT_STEP:]
    assert resumed == straight[CKPT_STEP:]


def sft_jsonl(path) -> str:
    # Ten conversations, each exactly one row of the default template under the test tokenizer.
    lines = [json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) for i in range(NUM)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_sft_mixture_loader_resumes_mid_epoch(tmp_path):
    source = sft_jsonl(tmp_path / "ten.jsonl")
    cfg = compose_config(
        [
            *(o for o in TINY if not o.startswith("data.eval_rows=")),
            "data.seq_len=16",
            f"+data.sources.ten.source={source}",
            "+data.sources.ten.val_size=1",
            "+data.sources.ten.max_epochs=2",
            "+data.sources.ten.string_rows=chat",  # string rows as chat turns: one row each (plain text packs several)
            "data.long_samples=error",
            "data.vocab_size=300",
            *_common(1000),
        ],
        recipe="sft",
        tiny=False,
    )
    cfg.data.sources = {"ten": cfg.data.sources.ten}  # only this source
    straight, resumed = _straight_and_resumed(cfg, tmp_path)
    # 9 training conversations (1 held out), 2 epochs, one row each: 18 steps, every one a new row
    # within its epoch, and the resumed run trains exactly steps 5..18 with the same rows.
    assert [s for s, _, _ in straight] == list(range(1, 2 * (NUM - 1) + 1))
    assert len({b for _, _, b in straight[: NUM - 1]}) == NUM - 1
    assert resumed == straight[CKPT_STEP:]


def test_a_finished_run_trained_longer_continues_its_epoch(tmp_path):
    """A run that ended at trainer.max_steps, resumed from its final checkpoint with a larger
    max_steps (`plait resume RUN trainer.max_steps=...`), trains the rest of its epoch as the longer
    run would have: its final checkpoint is written at the last step, mid-epoch, not after Lightning
    has closed the epoch (which made the resumed run start the next epoch)."""
    base = [*data_overrides("test_c07_mid_epoch_resume.rows", seq_len=SEQ_LEN), "data.shuffle=true"]
    longer = compose_config([*base, *_common(NUM + 4)])
    _, straight = fit(longer, tmp_path / "straight")
    short = compose_config([*base, *_common(6), "callbacks.checkpoint.every_n_steps=0"])
    fit(short, tmp_path / "short")
    _, resumed = fit(longer, tmp_path / "resumed", ckpt_path=str(tmp_path / "short" / "checkpoints" / "last"))
    assert [b for b in _batches(resumed.history) if b[0] > 6] == _batches(straight.history)[6:]
