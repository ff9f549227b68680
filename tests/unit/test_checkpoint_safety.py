"""Checkpoints trust nothing on disk: planted pickles do not run, damage is detected, resume falls
back to the newest intact checkpoint, pruning is atomic, and no NaN is ever saved or loaded.

Each payload test plants a pickle whose unpickling would create a marker file (what ``os.system``
or any other callable would do), makes the manifest match it (an attacker writes the whole
directory), and asserts that plait refuses it and the marker does not exist.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.manifest import MANIFEST
from strategies.checkpoint.safe_load import SafeLoadPlanner, UnsafePickleError
from trainer.callbacks.checkpoint import PeriodicCheckpoint
from trainer.loggers import RunCSVLogger
from trainer.rundir import RunDir, resolve_checkpoint, step_dir


class Payload:
    """Unpickling it creates ``marker`` (stands for any code an attacker wants run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (Path.touch, (self.marker,))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _save(path: Path, model: nn.Module | None = None, step: int = 1) -> Path:
    model = model or _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    ckpt.save(path, model=model, optimizers=[optimizer], meta={"global_step": step, "loops": {"x": [1, 2.5]}})
    return path


def _load(path: Path) -> dict:
    model = _model()
    return ckpt.load(path, model=model, optimizers=[torch.optim.AdamW(model.parameters(), lr=1e-2)])


# ------------------------------------------------------------------------------ planted payloads
def test_planted_dcp_metadata_does_not_run(tmp_path: Path) -> None:
    path, marker = _save(tmp_path / "step_0000001"), tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    ckpt.seal(path)
    with pytest.raises(ckpt.CheckpointError, match="refused to unpickle"):
        ckpt.load_model_weights(path, _model())  # generate, export, merge, model.init_from
    with pytest.raises(ckpt.CheckpointError, match="refused to unpickle"):
        _load(path)  # resume
    with pytest.raises(ckpt.CheckpointError, match="refused to unpickle"):
        ckpt.saved_entries(path)  # local SGD reads the metadata before loading
    assert not marker.exists()


@pytest.mark.parametrize("name", ["meta.pt", "rng/rank_00000.pt"])
def test_planted_meta_and_rng_files_do_not_run(tmp_path: Path, name: str) -> None:
    path, marker = _save(tmp_path / "step_0000001"), tmp_path / "ran"
    torch.save({"state": Payload(marker)}, path / name)
    ckpt.seal(path)
    with pytest.raises(ckpt.CheckpointError, match=f"{name}.*refused to unpickle"):
        _load(path)
    assert not marker.exists()


def test_planted_value_inside_a_dcp_shard_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    buffer.seek(0)

    class Item:  # the fields of a DCP ReadItem that load_bytes reads
        dest_index = type("Index", (), {"fqn": "optimizer_0.param_groups"})()

    with pytest.raises(UnsafePickleError):
        SafeLoadPlanner().load_bytes(Item(), buffer)
    assert not marker.exists()


def test_intact_checkpoint_loads(tmp_path: Path) -> None:
    path = _save(tmp_path / "step_0000001")
    assert ckpt.verify_checkpoint(path) is None
    assert _load(path)["loops"] == {"x": [1, 2.5]}


# ------------------------------------------------------------------------------ verification
def _overwrite(path: Path, offset: int = 64, size: int = 4096) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(os.urandom(min(size, path.stat().st_size - offset)))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: _overwrite(p / "__0_0.distcp"), "__0_0.distcp does not match its SHA-256"),
        (lambda p: (p / "meta.pt").write_bytes((p / "meta.pt").read_bytes()[:100]), "meta.pt has 100 bytes"),
        (lambda p: (p / "rng" / "rank_00000.pt").unlink(), "rng/rank_00000.pt missing"),
        (lambda p: (p / "rng" / "rank_00001.pt").write_bytes(b"x"), "rng/rank_00001.pt not in manifest"),
        (lambda p: (p / MANIFEST).unlink(), "no manifest.json"),
        (lambda p: (p / MANIFEST).write_text("{"), "manifest.json is unreadable"),
    ],
    ids=["overwritten_shard", "truncated_meta", "missing_file", "planted_file", "no_manifest", "bad_manifest"],
)
def test_damage_is_detected_and_resume_falls_back(tmp_path: Path, damage, reason: str) -> None:
    root = tmp_path / "run" / "checkpoints"
    older, newer = _save(step_dir(root, 2), step=2), _save(step_dir(root, 4), step=4)
    (root / "last").symlink_to(newer.name)
    damage(newer)
    assert reason in (ckpt.verify_checkpoint(newer) or "")
    skipped: list[str] = []
    assert resolve_checkpoint(tmp_path / "run", skipped.append) == older.resolve()
    assert len(skipped) == 1 and "step_0000004" in skipped[0] and reason in skipped[0], skipped
    assert resolve_checkpoint(newer) is None  # an explicit damaged checkpoint is not replaced by another
    assert RunDir(tmp_path / "run").holds_checkpoints()  # a fresh start into it is still refused


def test_resume_takes_the_newest_checkpoint_whatever_last_names(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    older, newer = _save(step_dir(root, 2), step=2), _save(step_dir(root, 4), step=4)
    (root / "last").symlink_to(older.name)  # a kill between the newer save's rename and the link update
    assert resolve_checkpoint(tmp_path / "run") == newer.resolve()


def test_a_save_killed_before_its_manifest_leaves_no_checkpoint(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"
    older = _save(step_dir(root, 2), step=2)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands for SIGKILL: the process ends right here

    monkeypatch.setattr(ckpt, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(step_dir(root, 4), step=4)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002", "step_0000004.tmp"]
    assert resolve_checkpoint(root) == older.resolve()


def test_prune_is_atomic_and_never_counts_damaged_checkpoints(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(step_dir(root, step), step=step)
    (step_dir(root, 3) / MANIFEST).unlink()  # the newest is incomplete: it must not push out a good one
    (root / "step_0000009.tmp").mkdir()  # leftovers of a killed save and a killed prune
    (root / ".pruned-step_0000000").mkdir()
    callback = PeriodicCheckpoint(dirpath=str(root), keep_last=2)
    callback._prune()
    assert sorted(p.name for p in root.iterdir()) == ["step_0000001", "step_0000002", "step_0000003"]

    # A kill inside the prune window (after the rename, before the delete) leaves no step_* name.
    _save(step_dir(root, 4), step=4)
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        callback._prune()
    assert sorted(p.name for p in root.iterdir()) == [
        ".pruned-step_0000001",
        "step_0000002",
        "step_0000003",
        "step_0000004",
    ]
    assert resolve_checkpoint(root) == step_dir(root, 4).resolve()


def test_a_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path: Path) -> None:
    """A run resumed from step 2 of its own directory (the divergence recovery) trains a new course: the
    newer checkpoints of the course it left move to checkpoints/superseded/, so retention keeps the new
    course's and resume=last continues it. Before, keep_last=1 deleted the new step_3 and kept the old
    step_4, and resume=last went on from it. Mutation: a resumed on_train_start that does not set them
    aside keeps step_0000004 in place and resolve_checkpoint picks it."""
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _save(step_dir(root, step), step=step)
    (root / "last").symlink_to("step_0000004")
    callback = PeriodicCheckpoint(dirpath=str(root), keep_last=1, save_on_signal=False)
    trainer = SimpleNamespace(ckpt_path=str(step_dir(root, 2)), is_global_zero=True, global_step=2, loggers=[])
    callback.on_train_start(trainer, None)
    aside = root / "superseded" / "after_step_0000002"
    assert sorted(p.name for p in aside.iterdir()) == ["step_0000003", "step_0000004"]
    assert os.readlink(root / "last") == "step_0000002" and resolve_checkpoint(root) == step_dir(root, 2).resolve()
    _save(step_dir(root, 3), step=3)  # the new course's step 3
    callback._prune()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003"]
    fresh = SimpleNamespace(ckpt_path=None, is_global_zero=True, global_step=0, loggers=[])
    PeriodicCheckpoint(dirpath=str(root), save_on_signal=False).on_train_start(
        fresh, None
    )  # a fresh start moves nothing
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003"]


def test_a_resume_from_a_superseded_checkpoint_leaves_no_last_naming_a_moved_one(tmp_path: Path) -> None:
    """A reviewer resumed from checkpoints/superseded/after_step_.../step_0000025 and killed the run
    before its first save: the newer checkpoints were set aside, but ``last`` still named step_0000040,
    now gone, so resume=last said "holds no intact checkpoint; start fresh" and a fresh start said
    "already holds checkpoints". Mutation: set_aside_newer without the unlink -> ``last`` dangles."""
    root = tmp_path / "checkpoints"
    for step in (30, 40):
        _save(step_dir(root, step), step=step)
    (root / "last").symlink_to("step_0000040")
    elsewhere = root / "superseded" / "after_step_0000020" / "step_0000025"
    _save(elsewhere, step=25)
    trainer = SimpleNamespace(ckpt_path=str(elsewhere), is_global_zero=True, global_step=25, loggers=[])
    PeriodicCheckpoint(dirpath=str(root), save_on_signal=False).on_train_start(trainer, None)
    assert not (root / "last").is_symlink() and not list(root.glob("step_*"))
    assert not RunDir(tmp_path).holds_checkpoints()  # a fresh start is allowed; the courses are kept aside
    assert sorted(p.name for p in (root / "superseded" / "after_step_0000025").iterdir()) == [
        "step_0000030",
        "step_0000040",
    ]


# ------------------------------------------------------------------------------ non-finite state
def test_no_checkpoint_is_written_from_a_non_finite_state(tmp_path: Path) -> None:
    model = _model()
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    with pytest.raises(ckpt.NonFiniteStateError, match=r"1\.bias"):
        _save(tmp_path / "step_0000005", model)
    assert list(tmp_path.iterdir()) == []


def test_a_non_finite_checkpoint_is_refused(tmp_path: Path, monkeypatch) -> None:
    model = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "non_finite_entry", lambda state: None)  # what an older plait wrote
        path = _save(tmp_path / "step_0000001", model)
    with pytest.raises(ckpt.NonFiniteStateError, match=r"0\.weight"):
        _load(path)
    with pytest.raises(ckpt.NonFiniteStateError):
        ckpt.load_model_weights(path, _model())


# ------------------------------------------------------------------------------ metrics.csv
def test_metrics_rows_after_the_checkpoint_are_dropped_by_the_continuing_run(tmp_path: Path) -> None:
    logger = RunCSVLogger(str(tmp_path))
    for step in range(6):  # a run killed after its step-6 row; its last checkpoint was step 3
        logger.log_metrics({"train/loss": 1.0 / (step + 1), **({"val/loss": 2.0} if step == 4 else {})}, step=step)
        logger.save()
    before = (tmp_path / "metrics.csv").read_text().splitlines(keepends=True)
    resumed = RunCSVLogger(str(tmp_path))  # the resumed run's logger: its first row is step 4
    resumed.log_metrics({"train/loss": 0.2}, step=4)
    resumed.save()
    after = (tmp_path / "metrics.csv").read_text().splitlines(keepends=True)
    assert after[:5] == before[:5]  # header and steps 0..3, byte for byte
    assert [line.split(",")[resumed.experiment.metrics_keys.index("step")] for line in after[1:]] == list("01234")


def test_a_resume_from_an_older_checkpoint_drops_the_rows_of_the_course_it_left(tmp_path: Path) -> None:
    """A reviewer's recovery from a divergence: a run logged steps 10, 20, 25 (its last row, off the
    cadence), was resumed from step_0000020 with a lower lr, and logged 30, 40: row 25 of the left
    course stayed between them (the first new row, 30, drops only rows of 30 and later). The
    checkpoint callback now drops the rows after the resumed step when training starts.
    Mutation: on_train_start without drop_after -> row 25 stays."""
    logger = RunCSVLogger(str(tmp_path))
    for step in (10, 20, 25):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    logger.save()
    resumed = RunCSVLogger(str(tmp_path))
    trainer = SimpleNamespace(ckpt_path="ckpt", is_global_zero=True, global_step=20, loggers=[resumed])
    PeriodicCheckpoint(dirpath=None, save_on_signal=False).on_train_start(trainer, None)
    for step in (30, 40):
        resumed.log_metrics({"train/loss": 1.0 / step}, step=step)
    resumed.save()
    column = resumed.experiment.metrics_keys.index("step")
    rows = (tmp_path / "metrics.csv").read_text().splitlines()[1:]
    assert [row.split(",")[column] for row in rows] == ["10", "20", "30", "40"]


class Marker:
    """A target whose construction creates ``marker`` (stands for any callable a config names)."""

    def __init__(self, marker: str, **kwargs: object) -> None:
        Path(marker).touch()


def test_planted_config_yaml_target_does_not_run(tmp_path: Path) -> None:
    from trainer.run_model import load_run_model
    from trainer.targets import UntrustedTargetError, check_targets

    run, marker = RunDir(tmp_path / "run"), tmp_path / "ran"
    _save(run.step(1))
    OmegaConf.save(
        OmegaConf.create(
            {"model": {"_target_": "test_checkpoint_safety.Marker", "marker": str(marker), "vocab_size": 8}}
        ),
        run.config,
    )
    with pytest.raises(
        UntrustedTargetError, match=r"model\._target_=test_checkpoint_safety.Marker.*trust=\[test_checkpoint_safety\]"
    ):
        load_run_model(run.path)  # generate, export and merge build the model this way
    assert not marker.exists()
    with pytest.raises(AttributeError):  # trusted by name: built (then it is no model)
        load_run_model(run.path, trust=["test_checkpoint_safety"])
    assert marker.exists()
    for target, why in [
        ("trainer.build.Path", "defined outside"),
        ("trainer.run.run", "neither a class"),
        ("torch.load", "outside plait's packages"),
        ("${oc.env:HOME}", "interpolation"),
        ("trainer.models.no_such_module.Model", r"cannot be imported .*plait --user-path DIR"),  # not on the path
    ]:
        with pytest.raises(UntrustedTargetError, match=why):
            check_targets(OmegaConf.create({"_target_": target}), source="config.yaml", key="model")
    check_targets(OmegaConf.create({"_target_": "trainer.models.hf.llama_from_hf"}), source="config.yaml", key="model")


def test_init_from_checks_the_run_model_before_it_is_taken(tmp_path: Path) -> None:
    """``model.init_from=<run>`` takes the run's model node (validate then builds it, nested targets
    first): what it takes from the file is checked as generate checks it; what the user gives is theirs."""
    from trainer.compose import compose
    from trainer.targets import UntrustedTargetError

    run, marker = RunDir(tmp_path / "run"), tmp_path / "ran"
    _save(run.step(1))
    saved = {
        "_target_": "trainer.models.llama.Llama",
        "dim": 48,
        "n_layers": 1,
        "n_heads": 4,
        "init_from": None,
        "rope_scaling": {"_target_": "builtins.open", "file": str(marker), "mode": "w"},
    }
    OmegaConf.save(OmegaConf.create({"model": saved}), run.config)
    with pytest.raises(
        UntrustedTargetError, match=r"model\.rope_scaling\._target_=builtins\.open is in Python's standard library"
    ):
        compose("pretrain", [f"model.init_from={run.path}"])
    taken = compose(
        "pretrain", [f"model.init_from={run.path}", "+model.rope_scaling=null"]
    ).model  # the user's own field
    assert (taken.dim, taken.n_layers, taken.rope_scaling) == (48, 1, None)  # the rest is the run's (tiny has dim 256)

    saved["rope_scaling"] = {"_target_": f"{__name__}.Marker", "marker": str(marker)}  # a package the user may trust
    OmegaConf.save(OmegaConf.create({"model": saved}), run.config)
    with pytest.raises(UntrustedTargetError, match=rf"trust=\[{__name__}\]"):
        compose("pretrain", [f"model.init_from={run.path}"])
    taken = compose("pretrain", [f"model.init_from={run.path}", f"trust=[{__name__}]"]).model
    assert taken.rope_scaling._target_ == f"{__name__}.Marker"
    assert not marker.exists()  # checked, taken, never built here


def test_a_run_whose_only_checkpoint_is_damaged_names_the_damage_and_a_fix_that_works(tmp_path: Path) -> None:
    """resume=last on a run whose one checkpoint is truncated said 'start fresh without resume', which
    the run directory then refused ('already holds checkpoints'); generate/export and model.init_from said
    it named no checkpoint at all. Each now says what is damaged, and resume names a fix that works.
    Mutation: load_run_model's error without no_checkpoint_reason loses 'bytes'."""
    from trainer.config import ConfigError
    from trainer.init_from import init_from_problems
    from trainer.run import check_run_dir
    from trainer.run_model import load_run_model

    run = tmp_path / "run"
    damaged = _save(step_dir(run / "checkpoints", 20), step=20)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError) as err:
        check_run_dir(OmegaConf.create({"run_dir": str(run), "resume": "last"}))
    (problem,) = err.value.problems
    assert "bytes" in problem and "start again in a new run_dir" in problem and "start fresh without" not in problem
    with pytest.raises(ConfigError, match="already holds checkpoints"):  # why resume's old advice went in a circle
        check_run_dir(OmegaConf.create({"run_dir": str(run), "resume": None}))
    with pytest.raises(FileNotFoundError, match="holds no intact checkpoint .*bytes"):
        load_run_model(damaged)
    (problem,) = init_from_problems(OmegaConf.create({"init_from": str(run)}))
    assert "holds no intact checkpoint" in problem and "bytes" in problem
    (problem,) = init_from_problems(OmegaConf.create({"init_from": str(tmp_path / "nowhere")}))
    assert "does not exist" in problem
    with pytest.raises(ConfigError, match="it does not exist"):
        check_run_dir(OmegaConf.create({"run_dir": str(run), "resume": str(tmp_path / "step_0000999")}))
