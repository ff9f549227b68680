"""RunDir and the model of a run: a run directory written by hand (DCP checkpoint, config.yaml,
tokenizer.json) loads back with its weights, whichever path names it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from hf_checkpoints import corpus_texts
from strategies.checkpoint import META_FILE, seal
from trainer.data.tokenizer import train_bpe
from trainer.rundir import RunDir, load_run_model, resolve_checkpoint

MODEL = {"_target_": "trainer.models.llama.Llama", "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "max_seq_len": 16}


def _write_run(path: Path, state: dict[str, torch.Tensor], *, steps: tuple[int, ...], tokenizer=None, vocab_size=None) -> RunDir:
    """A run directory as training leaves it: step checkpoints, ``last`` -> the newest, config, tokenizer."""
    run = RunDir(path)
    for step in steps:
        dcp.save({"model": state}, checkpoint_id=run.step(step))
        torch.save({}, run.step(step) / META_FILE)
        seal(run.step(step))  # its manifest: a checkpoint counts only with one
    os.symlink(run.step(steps[-1]).name, run.last)
    OmegaConf.save(OmegaConf.create({"model": {**MODEL, "vocab_size": vocab_size}}), run.config)
    if tokenizer is not None:
        tokenizer.save(str(run.tokenizer))
    return run


def _llama(vocab_size: int, seed: int) -> torch.nn.Module:
    from trainer.models.llama import Llama

    torch.manual_seed(seed)
    return Llama(**{k: v for k, v in MODEL.items() if k != "_target_"}, vocab_size=vocab_size)


def test_the_model_of_a_run_has_its_newest_weights(tmp_path: Path) -> None:
    tokenizer = train_bpe(corpus_texts(), vocab_size=300)
    old, new = _llama(tokenizer.vocab_size, 0), _llama(tokenizer.vocab_size, 1)
    run = _write_run(tmp_path / "run", old.state_dict(), steps=(2,), tokenizer=tokenizer)
    dcp.save({"model": new.state_dict()}, checkpoint_id=run.step(4))  # a newer step; `last` moves to it
    torch.save({}, run.step(4) / META_FILE)
    seal(run.step(4))
    run.last.unlink()
    os.symlink(run.step(4).name, run.last)
    for path in (run.path, run.checkpoints, run.last, tmp_path):  # run, checkpoints/, checkpoint, directory of runs
        loaded = load_run_model(path)
        assert loaded.checkpoint == run.step(4).resolve() and loaded.run == run
        assert loaded.tokenizer.vocab_size == tokenizer.vocab_size and not loaded.model.training
        assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), new.state_dict().values()))
    assert load_run_model(run.step(2)).checkpoint == run.step(2).resolve()


def test_a_run_without_tokenizer_takes_the_config_vocab(tmp_path: Path) -> None:
    model = _llama(40, 0)
    run = _write_run(tmp_path / "run", model.state_dict(), steps=(1,), vocab_size=40)
    run.last.unlink()  # a crash between a save and the link: the newest complete step counts
    loaded = load_run_model(run.path)
    assert loaded.tokenizer is None and loaded.model.vocab_size == 40 and loaded.checkpoint == run.step(1).resolve()


def test_a_path_without_checkpoint_is_named(tmp_path: Path) -> None:
    assert resolve_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="names no checkpoint"):
        load_run_model(tmp_path)
