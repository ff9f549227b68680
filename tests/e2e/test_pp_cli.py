"""`plait pretrain strategy=pp strategy.pipeline.schedule=1F1B trainer.devices=2` from the CLI, and its resume.

Two stages in two subprocess ranks (Lightning's launcher through Hydra). The first run trains 4
steps with checkpoints at steps 2 and 4; a second run resumes from the step-2 checkpoint into a new
run directory and must log bitwise the same steps 3 and 4 (model, optimizer, scheduler, RNG and
data position restored on both stages).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import CLI_TINY, plait, train_rows

RUN = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")] + [
    "strategy=pp",
    "strategy.pipeline.schedule=1F1B",
    "trainer.devices=2",
    "trainer.max_steps=4",
    "callbacks.checkpoint.every_n_steps=2",
    "callbacks.checkpoint.keep_last=0",
]


# Slow (~25 s of CLI runs): a pipeline checkpoint resumed at another pp degree is in the default
# run as tests/dist/test_pipeline.py::test_checkpoint_of_4_stages_resumes_at_another_pp_degree.
@pytest.mark.slow
def test_pp_cli_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    result = plait("pretrain", *RUN, f"run_dir={first}")
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    rows = train_rows(first)
    assert sorted(rows) == [1, 2, 3, 4]
    summary = json.loads((first / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_val_loss"] is not None

    checkpoint = first / "checkpoints" / "step_0000002"
    result = plait("pretrain", *RUN, f"run_dir={second}", f"resume={checkpoint}")
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    resumed = train_rows(second)
    assert sorted(resumed) == [3, 4], "steps 1-2 come from the checkpoint, not trained again"
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert resumed[step][key] == rows[step][key], (step, key)
