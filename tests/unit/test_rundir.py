"""RunDir and the model of a run: a run directory written by hand (DCP checkpoint, config.yaml,
tokenizer.json) loads back with its weights, whichever path names it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_checkpoints import corpus_texts
from omegaconf import OmegaConf

from strategies.checkpoint.dcp import META_FILE, seal
from trainer.data.tokenizer import train_bpe
from trainer.run_model import load_run_model
from trainer.rundir import RunDir, resolve_checkpoint

MODEL = {
    "_target_": "trainer.models.llama.Llama",
    "dim": 32,
    "n_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "max_seq_len": 16,
}


def _write_run(
    path: Path, state: dict[str, torch.Tensor], *, steps: tuple[int, ...], tokenizer=None, vocab_size=None
) -> RunDir:
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
    with pytest.raises(FileNotFoundError, match="holds no checkpoint; give a run directory"):
        load_run_model(tmp_path)


def test_a_folder_of_runs_names_the_one_that_saved_last_also_in_a_sweep(tmp_path: Path) -> None:
    # A --multirun folder: runs/pretrain/<time>/job<k>_<overrides>; the job that saved last is not
    # the last by name (job1 finished first: time, not name, decides).
    state = _llama(40, 0).state_dict()
    sweep = tmp_path / "pretrain" / "2026-12-01_10-00-00"
    early = _write_run(sweep / "job1_optim.lr:0.0003", state, steps=(1,), vocab_size=40)
    late = _write_run(sweep / "job0_optim.lr:0.001", state, steps=(1,), vocab_size=40)
    os.utime(early.step(1), (1_000_000, 1_000_000))
    os.utime(late.step(1), (2_000_000, 2_000_000))
    for path in (sweep, tmp_path / "pretrain", tmp_path):
        assert resolve_checkpoint(path) == late.step(1).resolve(), path
    os.utime(early.step(1), (3_000_000, 3_000_000))
    assert resolve_checkpoint(tmp_path / "pretrain") == early.step(1).resolve()


def test_a_sweep_job_directory_names_its_swept_values() -> None:
    from trainer.compose import swept_keys
    from trainer.rundir import job_dirname, run_name

    typed = ["model=nano", "optim.lr=1e-3,3e-4", "data.path=/a/b", "+x=range(2)"]
    assert swept_keys(typed) == ["optim.lr", "x"]
    assert (
        job_dirname(1, ["optim.lr=0.0003", "data.path=/a/b", "x=[1,2]"])
        == "job1_optim.lr:0.0003_data.path:%a%b_x:%1%2%"
    )
    assert job_dirname(0, []) == "job0"
    assert job_dirname(0, ["+strategy.tag=a"]) == "job0_strategy.tag:a"  # a reviewer's job0_+strategy.tag:a
    named = ["recipe=dpo", "model=nano", "run_dir=/x", "optim.lr=3e-4", "logger=wandb", "logger.wandb.offline=false"]
    assert run_name("pretrain", named) == "pretrain model=nano optim.lr=3e-4"


def test_an_unfinished_save_after_the_checkpoint_resumed_from_is_said(tmp_path: Path) -> None:
    """A kill during step 6's (asynchronous) write left step_0000006.tmp; the resume went on from step 4
    and the next save of step 6 removed it, without a word (a new user's walkthrough)."""
    run = _write_run(tmp_path / "run", _llama(40, 0).state_dict(), steps=(2, 4), vocab_size=40)
    for step in (2, 6):  # an older leftover is not this resume's business
        (run.checkpoints / f"{run.step(step).name}.tmp").mkdir()
    said: list[str] = []
    assert resolve_checkpoint(run.path, said.append) == run.step(4).resolve()
    assert said == [
        f"skipped {run.checkpoints / 'step_0000006.tmp'}: a save that did not finish (the run stopped while writing it)"
    ]


def test_a_damaged_newest_checkpoint_passed_over_is_reported(tmp_path: Path) -> None:
    """plait generate loaded the previous checkpoint and said only 'loaded .../step_1', while resume said
    it skipped the damaged step_2 and why."""
    model = _llama(40, 0)
    run = _write_run(tmp_path / "run", model.state_dict(), steps=(1, 2), vocab_size=40)
    shard = next(run.step(2).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    lines: list[str] = []
    loaded = load_run_model(run.path, report=lines.append)
    assert loaded.checkpoint == run.step(1).resolve()
    assert len(lines) == 1 and "step_0000002" in lines[0] and "bytes" in lines[0]
