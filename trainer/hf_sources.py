"""The Hugging Face directories that describe a run's model: where an export takes its
``config.json`` fields, generation and tokenizer files from (`trainer.export`, the
``callbacks.hf_export`` callback, and validate's check that the model fits a family)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trainer.models.hf import is_hf_dir, read_config


def source_dirs(run_cfg: DictConfig, *, tokenizer: bool = True) -> list[Path]:
    """Directories whose tokenizer/generation files describe this run's model: the Hugging Face
    ``model.init_from`` and the directory of ``data.tokenizer`` (first found wins per file).

    Args:
        tokenizer: include ``data.tokenizer``'s directory; False: the model's own directories only,
            those whose ``config.json`` is the model's (`base_config`): a tokenizer taken from a
            Hugging Face model's folder says nothing of the architecture trained.
    """
    out = []
    model = run_cfg.model if run_cfg.model is not None else {}
    for directory in (
        model.get("init_from"),
        model.get("config_from"),
    ):  # config_from: a chain from a Hugging Face model
        if directory and is_hf_dir(directory):
            out.append(Path(directory).expanduser())
    path = run_cfg.data.get("tokenizer") if run_cfg.get("data") is not None else None
    if tokenizer and path:
        out.append(Path(path).expanduser().parent)
    return out


def base_config(sources: list[Path]) -> dict[str, Any] | None:
    """The ``config.json`` of the first Hugging Face directory among ``sources``, or None."""
    return next((read_config(d) for d in sources if is_hf_dir(d)), None)
