"""A clean ``model=hf`` config logs no error on any path that looks at its model node: validate,
``plait plan`` and building the model and the trainer's loggers and callbacks. Hydra's
``get_class`` logged "Error getting class at trainer.models.hf.llama_from_hf" (a factory function)
on every launch; tests/unit/test_hf.py checks validate alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hf_checkpoints import make_hf_dir, write_tokenizer  # skips the module without transformers

from trainer import plan
from trainer.build import build_callbacks, build_loggers, build_model
from trainer.compose import compose
from trainer.config import validate


def test_model_hf_paths_log_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_hf_dir("llama3", tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    cfg = compose("pretrain", ["model=hf", f"model.init_from={tmp_path / 'hf'}", "data.seq_len=64", "cluster=h100x8"])
    with caplog.at_level(logging.ERROR):
        run = validate(cfg)
        build_model(cfg, run, vocab_size=300)
        build_loggers(cfg, tmp_path / "run")
        build_callbacks(cfg, tmp_path / "run")
        plan.main(["model=hf", f"model.init_from={tmp_path / 'hf'}", "data.seq_len=64", "cluster=h100x8"])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
