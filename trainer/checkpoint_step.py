"""A checkpoint is the step its name says: its directory name, ``meta.pt`` and its optimizer state agree.

plait names each checkpoint after the optimizer step it holds (``step_0000300``); Lightning's loop
state in ``meta.pt`` records that step (``global_step``, with the schedule and the data position
that go with it); an Adam-family optimizer state counts the updates it applied (``step`` of each
parameter: the step count, less the non-finite steps it skipped). The manifest only proves that
the files are the ones written together, so a ``meta.pt`` copied in from another checkpoint (and
the manifest rewritten), or a directory renamed, would resume the loop of one step with the
weights of another, silently. `step_problem` compares the three before anything is written.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from strategies.checkpoint.dcp import META_FILE, is_checkpoint
from strategies.checkpoint.safe_load import UnsafePickleError, load_dcp, load_plain, read_dcp_metadata

_OPTIMIZER_STEP = re.compile(r"(?:^|\.)optimizer_0\.state\..+\.step$")


def name_step(checkpoint: Path) -> int | None:
    """The step a ``step_<n>`` directory name says (None: another name, a merge's ``last``)."""
    match = re.fullmatch(r"step_(\d+)", Path(checkpoint).name)
    return int(match.group(1)) if match else None


def meta_step(checkpoint: Path) -> int | None:
    """``global_step`` of the checkpoint's ``meta.pt`` (None: none recorded, or a file the load
    itself refuses with its own message)."""
    try:
        meta = load_plain(Path(checkpoint) / META_FILE)
    except (UnsafePickleError, OSError, RuntimeError, EOFError, ValueError):
        return None
    step = meta.get("global_step") if isinstance(meta, dict) else None
    return int(step) if isinstance(step, int) else None


def optimizer_step(checkpoint: Path) -> int | None:
    """The most updates any parameter's optimizer state counts (``optimizer_0``'s ``step``), read
    from the DCP shards (None: an optimizer without a step count, such as SGD)."""
    try:
        entries = read_dcp_metadata(checkpoint).state_dict_metadata
        state = {
            key: torch.zeros(meta.size, dtype=meta.properties.dtype)
            for key, meta in entries.items()
            if _OPTIMIZER_STEP.search(key) and hasattr(meta, "size")
        }
        if not state:
            return None
        load_dcp(state, checkpoint)
    except Exception:  # noqa: BLE001 - damaged shards: the load reports them with its own message
        return None
    return int(max(float(value.max()) for value in state.values()))


def step_problem(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` is not the step its name says, or None.

    Refused: a ``meta.pt`` whose ``global_step`` differs from the ``step_<n>`` name, or an
    optimizer state that counts more updates than ``global_step`` steps ran. Fewer is allowed:
    skipped non-finite steps leave the counts behind (`trainer.nonfinite`).
    """
    checkpoint = Path(checkpoint)
    named, recorded = name_step(checkpoint), meta_step(checkpoint)
    if recorded is None:
        return None
    updates = optimizer_step(checkpoint)
    if (named is None or named == recorded) and (updates is None or updates <= recorded):
        return None
    said = [f"{checkpoint}/{META_FILE} records step {recorded}"]
    said += [f"its directory name says step {named}"] if named is not None else []
    said += [f"its optimizer state counts {updates} updates"] if updates is not None else []
    return (
        f"{', '.join(said)}: its weights and its loop state (schedule, data position) belong to different "
        f"steps; {_fix(checkpoint)}"
    )


def _fix(checkpoint: Path) -> str:
    """Resume from the newest other complete checkpoint of the same run, if there is one."""
    named = name_step(checkpoint)
    others = [
        p for p in checkpoint.parent.glob("step_*")
        if p != checkpoint and is_checkpoint(p) and (s := name_step(p)) is not None and (named is None or s < named)
    ]  # fmt: skip
    if not others:
        return f"move {checkpoint} out of {checkpoint.parent} and start a new run_dir (no earlier checkpoint to resume from)"
    earlier = max(others, key=lambda p: name_step(p) or 0)
    return (
        f"resume from the checkpoint before it with resume={earlier} (or move {checkpoint} out of {checkpoint.parent})"
    )
