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

    # A fresh interpreter, torchao never imported: the weights load through the weights-only reader.
    code = (
        "import pathlib, sys, torch\n"
        "from strategies.checkpoint.dcp import saved_entries\n"
        "from strategies.checkpoint.safe_load import load_dcp\n"
        "path = pathlib.Path(sys.argv[1])\n"
        "state = {'model': {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in saved_entries(path, 'model.').items()}}\n"
        "load_dcp(state, path)\n"
        "assert 'torchao' not in sys.modules\n"
        "print(sum(bool(t.abs().sum() > 0) for t in state['model'].values()), len(state['model']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint)], capture_output=True, text=True, env=env_with_tests(), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded, saved = map(int, result.stdout.split())
    assert loaded == saved > 10, result.stdout  # every weight read, none left at zero
