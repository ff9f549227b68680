"""PAFT's merge takes each arm's difference from the base it was fine-tuned from: a LoRA arm trained
from a base run records that run's checkpoint at launch (`trainer.init_from.take_run_model`), and
every run records in its checkpoints the one its first step started from
(`trainer.resume_record.ResumeRecord`, `trainer.init_from.started_from`), so a base run that trained on
since is caught (`trainer.merge.base_problems`), not merged against weights the arm never started
from."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from trainer.compose import compose
from trainer.merge import base_problems
from trainer.resume_record import ResumeRecord
from trainer.run_model import RunModel
from trainer.rundir import RunDir, resolve_checkpoint


def _checkpoint(run: Path, step: int, weights: str = "") -> Path:
    """A sealed checkpoint of ``run`` at ``step`` whose content (so its manifest's digest) is the step's and ``weights``."""
    from strategies.checkpoint.manifest import checkpoint_files, hash_files, write_manifest

    ckpt = run / "checkpoints" / f"step_{step:07d}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(f"step {step} {weights}".encode())
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


def _recorded_checkpoint(run: Path, step: int, record: ResumeRecord) -> Path:
    """A checkpoint of ``run`` whose ``meta.pt`` holds ``record``'s run record, as the callback saves it."""
    from strategies.checkpoint.manifest import checkpoint_files, hash_files, write_manifest

    ckpt = run / "checkpoints" / f"step_{step:07d}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    meta: dict = {}
    record.on_save_checkpoint(None, None, meta)
    torch.save(meta, ckpt / "meta.pt")
    write_manifest(ckpt, hash_files(ckpt, checkpoint_files(ckpt)))
    return ckpt


def test_a_full_fine_tune_records_the_checkpoint_it_started_from(tmp_path: Path) -> None:
    """A full fine-tune keeps the base run's directory as model.init_from; the checkpoint its first step
    loaded is recorded at the fresh start and carried by a resume after the base trained on (mutation:
    taking it from model.init_from on the resume too records the base's newer step_24)."""
    base_dir = tmp_path / "base"
    first = _checkpoint(base_dir, 20)
    tokenizer = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    cfg = OmegaConf.create({"model": {"init_from": str(base_dir)}})
    fresh = ResumeRecord(cfg, tokenizer, tmp_path / "arm", {})
    assert fresh.record["base"]["checkpoint"] == str(first.resolve())
    own = _recorded_checkpoint(tmp_path / "arm", 3, fresh)
    _checkpoint(base_dir, 24)  # the base run trained on
    resumed = ResumeRecord(cfg, tokenizer, tmp_path / "arm", {}, checkpoint=own)
    assert resumed.record["base"] == fresh.record["base"]
    assert ResumeRecord(OmegaConf.create({"model": {}}), tokenizer, tmp_path / "x", {}).record["base"] is None


def test_a_full_fine_tune_arm_whose_base_trained_on_is_refused(tmp_path: Path) -> None:
    """The arm's model.init_from names the base run's directory (its newest checkpoint now): its record,
    not that path, says what it started from. Mutation: comparing model.init_from's checkpoint again
    passes the moved base (and refuses the checkpoint the arm did start from)."""
    base_dir = tmp_path / "base"
    first = _checkpoint(base_dir, 20)
    base_cfg = compose("pretrain", ["model=nano", "data.seq_len=64"])
    _run(base_dir, base_cfg)
    arm_cfg = compose("sft", [f"model.init_from={base_dir}", "data.seq_len=64"])
    assert arm_cfg.model.init_from == str(base_dir)  # a full fine-tune: the directory, not pinned
    tokenizer = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    arm_dir = tmp_path / "arm"
    _recorded_checkpoint(arm_dir, 3, ResumeRecord(arm_cfg, tokenizer, arm_dir, {}))
    arm = _run(arm_dir, arm_cfg)
    assert base_problems(_run(base_dir, base_cfg), [("arm", arm)]) == []
    _checkpoint(base_dir, 24)  # the base run trained on
    (problem,) = base_problems(_run(base_dir, base_cfg), [("arm", arm)])
    assert f"fine-tuned from the checkpoint {first.resolve()}" in problem and "step_0000024" in problem
    assert f"merge with base={first.resolve()}" in problem
    at_first = RunModel(model=None, tokenizer=None, config=base_cfg, run=RunDir(base_dir), checkpoint=first)
    assert base_problems(at_first, [("arm", arm)]) == []  # the checkpoint the arm started from
    aside = base_dir / "checkpoints" / "superseded" / "after_step_0000010"
    aside.mkdir(parents=True)
    first.rename(aside / first.name)  # a resume of the base from step 10 set it aside; its new course saves step 20
    _checkpoint(base_dir, 20, weights="other")
    (problem,) = base_problems(_run(base_dir, base_cfg), [("arm", arm)])  # the newest: step 24
    assert f"merge with base={aside / first.name}" in problem
    same = RunModel(model=None, tokenizer=None, config=base_cfg, run=RunDir(base_dir), checkpoint=first)
    (problem,) = base_problems(same, [("arm", arm)])  # the name the arm recorded, other weights
    assert "as it was then; that checkpoint holds other weights now" in problem
    assert RunDir.of_checkpoint(aside / first.name).path == base_dir  # generate, export, merge can open it
    shutil.rmtree(aside)  # gone for good
    (problem,) = base_problems(_run(base_dir, base_cfg), [("arm", arm)])
    assert "holds those weights now" in problem and "fine-tune it again" in problem
