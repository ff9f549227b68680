"""PAFT's merge takes each arm's difference from the base it was fine-tuned from: a LoRA arm trained
from a base run records that run's checkpoint at launch (`trainer.init_from.take_run_model`), so a
base run that trained on since is caught (`trainer.merge.base_problems`), not merged against weights
the arm never started from."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from trainer.compose import compose
from trainer.merge import base_problems
from trainer.rundir import RunDir, RunModel, resolve_checkpoint


def _checkpoint(run: Path, step: int) -> Path:
    from strategies.checkpoint.manifest import checkpoint_files, hash_files, write_manifest

    ckpt = run / "checkpoints" / f"step_{step:07d}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "meta.pt").write_bytes(b"")
    write_manifest(ckpt, hash_files(ckpt, checkpoint_files(ckpt)))
    return ckpt


def _run(path: Path, cfg) -> RunModel:
    path.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path / "config.yaml", resolve=True)
    return RunModel(model=None, tokenizer=None, config=cfg, run=RunDir(path), checkpoint=resolve_checkpoint(path))


def test_an_arm_whose_base_trained_on_is_refused(tmp_path: Path) -> None:
    """Mutation: recording the base run's directory (not its checkpoint) passes the moved base."""
    base_dir = tmp_path / "base"
    _checkpoint(base_dir, 20)
    base_cfg = compose("pretrain", ["model=nano", "data.seq_len=64"])
    _run(base_dir, base_cfg)
    # a LoRA arm, as its launch composes it (a full fine-tune records the base's directory)
    arm_cfg = compose("sft", [f"model.init_from={base_dir}", "+strategy/lora=default", "data.seq_len=64"])
    arm_dir = tmp_path / "arm"
    _checkpoint(arm_dir, 3)
    arm = _run(arm_dir, arm_cfg)
    assert base_problems(_run(base_dir, base_cfg), [("arm", arm)]) == []
    _checkpoint(base_dir, 24)  # the base run trained on
    (problem,) = base_problems(_run(base_dir, base_cfg), [("arm", arm)])
    assert "step_0000020" in problem and "not from base=" in problem and "step_0000024" in problem
