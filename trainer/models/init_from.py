"""``model.init_from``: loading a Hugging Face directory or a plait checkpoint / run directory
into a (possibly parallelized) model, and the checks `trainer.config.validate` makes of it first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from strategies.lora import is_adapter
from trainer.models.hf import HFError, is_hf_dir, llama_kwargs, load_hf_weights, read_config, sliding_window, weight_files


def load_init_from(model: nn.Module) -> None:
    """Loads ``model.init_from`` (a Hugging Face directory or a plait checkpoint / run directory)
    into the (possibly parallelized) model; nothing when it is None. Every rank calls it. LoRA
    adapters (`strategies.lora.is_adapter`) are not loaded: the base is.

    Raises:
        HFError: ``init_from`` is neither, or its weights do not fit the model.
    """
    source = getattr(model, "init_from", None)
    if not source:
        return
    if is_hf_dir(source):
        load_hf_weights(model, source)
        return
    from trainer.rundir import load_run_weights

    try:
        load_run_weights(source, model, keys=lambda fqn: not is_adapter(fqn))
    except FileNotFoundError:
        raise HFError(f"model.init_from={source} is neither a Hugging Face directory nor a plait checkpoint") from None


def init_from_problems(model: Any, *, data: Any = None) -> list[str]:
    """Problems of ``model.init_from`` for `trainer.config.validate` (before any process group).

    The layout is checked against the checkpoint's sizes by the plugins (on the model's shape,
    which validate builds from the same config.json).

    Args:
        model: the composed ``model`` node (``init_from`` set).
        data: the ``data`` node (its ``seq_len`` against the checkpoint's context and window).
    """
    from trainer.rundir import resolve_checkpoint

    source, target = str(model.init_from), str(model.get("_target_", ""))
    wants_hf = target.endswith("llama_from_hf")
    if not is_hf_dir(source):
        if wants_hf:
            return [f"model.init_from={source} has no config.json; model=hf needs a Hugging Face model directory"]
        if resolve_checkpoint(Path(source).expanduser()) is None:
            return [
                f"model.init_from={source} is neither a Hugging Face model directory (config.json) nor a plait "
                "checkpoint or run directory"
            ]
        return []
    if not wants_hf:
        return [
            f"model.init_from={source} is a Hugging Face directory, whose config.json sets the architecture: "
            f"use model=hf model.init_from={source}"
        ]
    try:
        config = read_config(source)
        kwargs = llama_kwargs(config)
        weight_files(source)
    except HFError as err:
        return [f"model.init_from={source}: {err}"]
    problems = []
    max_seq_len = model.get("max_seq_len") or kwargs["max_seq_len"]
    window = sliding_window(config)
    seq_len = data.get("seq_len") if data is not None else None
    if model.get("max_seq_len") and model.max_seq_len > kwargs["max_seq_len"]:
        problems.append(
            f"model.max_seq_len={model.max_seq_len} exceeds the checkpoint's context of {kwargs['max_seq_len']} "
            f"(max_position_embeddings{' and sliding_window' if window else ''} of {source}/config.json)"
        )
    elif seq_len and seq_len > max_seq_len:
        problems.append(f"data.seq_len={seq_len} exceeds the checkpoint's context of {max_seq_len}; lower data.seq_len")
    if data is not None and "tokenizer" in data and data.tokenizer is None:
        if not (Path(source).expanduser() / "tokenizer.json").is_file():
            problems.append(f"model.init_from={source} has no tokenizer.json; give its tokenizer with data.tokenizer=...")
    return problems
