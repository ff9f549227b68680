"""A float8 run under FSDP2 (the float8 all-gather) writes plain checkpoints: every reader loads them,
and the run resumes from one bitwise.

Under the float8 all-gather torchao keeps each converted weight's shard as a tensor subclass; DCP
pickled that class into the checkpoint, which only a resumed float8 run (torchao imported) could read
back: ``plait export``, ``eval``, ``generate`` and ``model.init_from`` refused it (a new user's
walkthrough). `strategies.checkpoint.plain_tensors` saves the wrapped tensor instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import compose_config, env_with_tests, fit, losses

RUN = (
    "strategy=fsdp",
    "trainer.devices=2",
    "strategy.float8.recipe=tensorwise",
    "trainer.max_steps=4",
    "callbacks.checkpoint.every_n_steps=2",
    "callbacks.checkpoint.keep_last=0",
)


def test_a_float8_all_gather_checkpoint_is_plain_and_resumes_bitwise(tmp_path: Path) -> None:
    _, straight = fit(compose_config(list(RUN)), tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_0000002"
    _, resumed = fit(compose_config(list(RUN)), tmp_path / "resumed", ckpt_path=str(checkpoint))
    assert losses(resumed.history)[2:] == losses(straight.history)[2:]  # steps 3 and 4, bitwise

    loaded, saved = _loads_without_torchao(checkpoint, "model.")
    assert loaded == saved > 10  # every weight read, none left at zero


def test_a_float8_diloco_checkpoint_holds_plain_anchors(tmp_path: Path) -> None:
    """DiLoCo's anchors clone the float8-cast weights, and its islands' states ride in the checkpoint
    beside the model's: they are saved plain too (a fresh reviewer)."""
    run = [
        "strategy=diloco",
        "strategy.dp_shard=2",
        "trainer.devices=4",
        "strategy.local_sgd.sync_every=1",
        "train.micro_batch_size=2",
    ]
    fit(compose_config([*run, "strategy.float8.recipe=tensorwise", "trainer.max_steps=2"]), tmp_path)
    loaded, saved = _loads_without_torchao(tmp_path / "checkpoints" / "step_0000002", "local_sgd")
    assert saved > 40 and loaded > 0, (loaded, saved)


def _loads_without_torchao(checkpoint: Path, prefix: str) -> tuple[int, int]:
    """(tensors read non-zero, tensors saved) under ``prefix``, read in a fresh interpreter where torchao
    was never imported, through the weights-only reader."""
    code = (
        "import pathlib, sys, torch\n"
        "from strategies.checkpoint.dcp import saved_entries\n"
        "from strategies.checkpoint.safe_load import load_dcp\n"
        "path, prefix = pathlib.Path(sys.argv[1]), sys.argv[2]\n"
        "entries = {k: m for k, m in saved_entries(path).items() if k.startswith(prefix) and hasattr(m, 'size')}\n"
        "state = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in entries.items()}\n"
        "load_dcp(state, path)\n"
        "assert 'torchao' not in sys.modules\n"
        "print(sum(bool(t.abs().sum() > 0) for t in state.values()), len(state))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), prefix],
        capture_output=True,
        text=True,
        env=env_with_tests(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded, saved = map(int, result.stdout.split())
    return loaded, saved


def test_a_rollback_under_the_float8_all_gather_casts_with_the_restored_weights_scales(tmp_path: Path) -> None:
    """The scales are precomputed after each step from the weights; a rollback loaded older weights
    and the next step cast them with the discarded weights' scales (a reviewer's run: the all-gather
    on and off agreed bitwise up to the rollback, then 6.9639 against 6.9660). With the scales of the
    loaded weights (`Float8.after_load`), both agree bitwise through it."""
    run = [
        "model=nano", "data.seq_len=64", "train.eval_every=0", "trainer.log_every_n_steps=1", "logger=none",
        "~callbacks.plots", "trainer.enable_progress_bar=false", "strategy.timeout_s=120",
        *RUN[:3], "scheduler=constant", "scheduler.warmup_steps=6", "optim.lr=0.05", "trainer.max_steps=8",
        "callbacks.checkpoint.every_n_steps=1", "callbacks.checkpoint.keep_last=0", "train.nonfinite=rollback",
        "train.max_nonfinite_steps=1", "train.spike_factor=3", "train.spike_window=3",
    ]  # fmt: skip
    _, on = fit(compose_config(run, tiny=False), tmp_path / "on")
    _, off = fit(compose_config([*run, "strategy.float8.fsdp_float8_all_gather=false"], tiny=False), tmp_path / "off")
    spike, after = losses(on.history)[6:8]
    assert spike > 1.3 * losses(on.history)[5] > after, "step 7's spike rolls back to step 5"
    assert losses(on.history) == losses(off.history)
