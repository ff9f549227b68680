"""DiLoCo inside FSDP islands (dp_replicate 2 x dp_shard 2, 4 processes) trains and resumes from the CLI.

A straight run of 6 steps (H = 2: outer steps after steps 2, 4 and 6) checkpoints after step 3, in
the middle of a round. A second run resumes from that checkpoint in its own run directory: its
steps 4-6 must log the straight run's losses, gradient norms and bytes bitwise, and its summary
the same final validation loss and total bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import CLI_TINY, plait, train_rows

RUN = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")] + [
    "strategy=diloco",
    "strategy.dp_shard=2",
    "trainer.devices=4",
    "train.micro_batch_size=2",
    "strategy.local_sgd.sync_every=2",
    "trainer.max_steps=6",
    "callbacks.checkpoint.every_n_steps=3",
    "callbacks.checkpoint.keep_last=0",
]


def _ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.mark.slow
def test_diloco_in_fsdp_islands_trains_and_resumes_mid_round(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _ok(plait(*RUN, f"run_dir={straight}"))
    _ok(plait(*RUN, f"run_dir={resumed}", f"resume={straight / 'checkpoints' / 'step_0000003'}"))

    reference, rows = train_rows(straight), train_rows(resumed)
    for step in (4, 5, 6):
        for key in ("train/loss", "train/grad_norm", "comm/bytes_sent", "comm/bytes_sent_total"):
            assert rows[step][key] == reference[step][key], (step, key)
    # Outer steps after steps 2, 4, 6 only; each rank sends its FSDP shard of the pseudo-gradient.
    sent = [float(reference[step]["comm/bytes_sent"]) for step in range(1, 7)]
    assert sent[0] == sent[2] == sent[4] == 0.0 and sent[1] == sent[3] == sent[5] > 0
    summary, expected = (json.loads((d / "summary.json").read_text()) for d in (resumed, straight))
    assert summary["final_val_loss"] == expected["final_val_loss"]
    assert summary["comm_bytes_sent_per_rank"] == expected["comm_bytes_sent_per_rank"] == 3 * sent[1]
    assert float(reference[6]["train/loss"]) < float(reference[1]["train/loss"])  # it trains
