"""One training run inside a Hydra job: check, prepare data, build, write the run directory, fit."""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from strategies.checkpoint.dcp import CheckpointError, NonFiniteStateError
from strategies.core.parallel_dims import MESH_AXES
from strategies.core.resolved import ResolvedRun
from strategies.muon import launch_line as muon_line
from strategies.runtime.launch import LAUNCH_ENV, launch_problems
from strategies.runtime.terminal import write_line
from strategies.runtime.watchdog import ABORT_EXIT
from trainer.budget.driver import DriverError, is_search, run_search
from trainer.build import build_fit, prepared_data
from trainer.checkpoint_step import meta_step, step_problem
from trainer.config import ConfigError, validate
from trainer.data.base import DataError, DataModule
from trainer.data.summary import describe, epochs_line
from trainer.failed_start import nothing_left_untrained, refused_start
from trainer.finetune_defaults import lr_line
from trainer.nonfinite import NonFiniteError
from trainer.optim import WarmupDecayLR, lr_factor
from trainer.planning import check_memory
from trainer.replica_groups import gpu_problems, group_problems, launches_groups, run_replica_groups
from trainer.resume import RESUMES_FILE, check_resume, resume_changes
from trainer.resume_record import ResumeRecord
from trainer.rl.rewards import RewardError
from trainer.run_length import DATA_EXHAUSTED, RunLength, plan_run_length
from trainer.rundir import RunDir, last_link_problem, resolve_checkpoint
from trainer.task import Task


def _is_launching_rank() -> bool:
    """Whether this process is global rank 0: the one that writes the run directory's files.

    Before Lightning sets up the ranks, a process's rank is in the launcher's variables: torchrun's
    ``RANK``, SLURM's ``SLURM_PROCID`` (srun starts every task, on every node, before Lightning
    sets ``RANK``), or ``LOCAL_RANK``/``NODE_RANK`` of a child plait started itself.
    """
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def check_run_dir(
    cfg: DictConfig, run_dir: Path | None = None, report: Callable[[str], None] | None = None
) -> Path | None:
    """The checkpoint to resume from (None for a fresh start): the newest one that verifies.

    Args:
        report: called with each checkpoint passed over (and why) and the one resumed from.

    Raises:
        ConfigError: a ``run_dir`` that is (or lies under) a file, a fresh start into a run
            directory that already has checkpoints, or a
            ``resume`` that names no intact checkpoint (the damaged ones listed).
        CheckpointError: a resume into a run directory whose ``checkpoints/last`` is not the
            link plait writes (its first save could not move it), or from a checkpoint whose
            ``meta.pt`` records another step than its name and optimizer state (`step_problem`).
    """
    run_dir = Path(run_dir if run_dir is not None else cfg.run_dir)
    blocked = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ConfigError([f"run_dir={run_dir}: {blocked} is a file, not a directory; choose another run_dir"])
    if cfg.resume is None:
        if RunDir(run_dir).holds_checkpoints():
            raise ConfigError(
                [
                    f"run_dir={run_dir} already holds checkpoints; continue it with plait resume {run_dir} (its own "
                    "config), or choose a new run_dir"
                ]
            )
        return None
    if (problem := last_link_problem(RunDir(run_dir).checkpoints)) is not None:
        raise CheckpointError(problem)
    skipped: list[str] = []
    found = resolve_checkpoint(run_dir if cfg.resume == "last" else cfg.resume, skipped.append)
    if found is None:
        where = f"run_dir={run_dir}" if cfg.resume == "last" else f"resume={cfg.resume}"
        if skipped:  # damaged checkpoints: a fresh start into their run directory is refused too
            fix = (
                f" ({'; '.join(skipped)}); point resume at an intact checkpoint, or start again in a new run_dir "
                f"(or move {RunDir(run_dir).checkpoints} away, keeping the damaged ones for inspection, and start fresh there)"
            )
        elif not Path(run_dir if cfg.resume == "last" else cfg.resume).expanduser().exists():
            fix = " (it does not exist); point resume at a run or a checkpoint, or start fresh without resume"
        else:
            fix = "; start fresh without resume (plait resume needs one), or point it at a run"
        raise ConfigError([f"{where} holds no intact checkpoint{fix}"])
    if (problem := step_problem(found)) is not None:
        raise CheckpointError(problem)
    step, max_steps = meta_step(found), OmegaConf.select(cfg, "trainer.max_steps", default=None)
    if step is not None and isinstance(max_steps, int) and 0 <= max_steps <= step:
        raise ConfigError(
            [
                f"{found} is at step {step} and trainer.max_steps={max_steps}: the resume would train nothing; raise trainer.max_steps"
            ]
        )
    for line in [*skipped, f"resuming from {found}"]:
        if report is not None:
            report(line)
    return found


def _print(line: str) -> None:
    print(f"plait: {line}", file=sys.stderr)


def check_train_batches(cfg: DictConfig, data: DataModule) -> None:
    """Rejects a fractional ``trainer.limit_train_batches`` that leaves no batch of an epoch.

    Lightning takes ``int(batches x limit)`` batches per epoch; 0 would be a run that trains
    nothing, so it is a configuration error, found once the data says how many batches there are
    (case C30).

    Raises:
        DataError: the limit rounds the epoch down to zero batches.
    """
    limit, num_batches = cfg.trainer.limit_train_batches, data.steps_per_epoch()
    if isinstance(limit, float) and int(num_batches * limit) < 1:
        raise DataError(
            f"trainer.limit_train_batches={limit} of {num_batches} training batches per epoch leaves no batch "
            f"(int({num_batches} x {limit}) = 0); raise it to at least "
            f"{math.ceil(10_000 / max(num_batches, 1)) / 10_000:g}, give a batch count, or drop it"
        )


@dataclass(frozen=True)
class Launch:
    """What one launch has checked: the resolved run and the checkpoint it resumes from (or None)."""

    run: ResolvedRun
    ckpt_path: Path | None


def check_launch(cfg: DictConfig, run_dir: Path | None = None) -> Launch:
    """Everything a launch checks before it starts processes or writes files, once: `validate`,
    whether the processes can be started here (`strategies.runtime.launch.launch_problems`), the
    predicted memory (``planner.check``), the run directory (`check_run_dir`) and the resume
    (`trainer.resume.check_resume`).

    Raises:
        ConfigError: every problem of the config, a predicted out-of-memory, or a run directory
            that does not fit ``resume``.
    """
    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    typed = isinstance(devices, int) and isinstance(nodes, int)  # else validate reports them
    unlaunchable = launch_problems(str(cfg.trainer.accelerator), devices, nodes) if typed else []
    if cfg.strategy.get("fault_tolerance") is not None:  # replica groups (`trainer.replica_groups`)
        unlaunchable += group_problems(cfg)
        if launches_groups(cfg):
            unlaunchable += gpu_problems(cfg, torch.cuda.device_count())
    try:
        resolved = validate(cfg)
    except ConfigError as err:
        raise ConfigError([*err.problems, *unlaunchable]) from None
    if unlaunchable:
        raise ConfigError(unlaunchable)
    if cfg.planner.check:  # a predicted out-of-memory fails here, before any process starts
        check_memory(cfg, resolved)
    if is_search(cfg):  # its runs start fresh in directories of their own (trainer.budget.driver)
        return Launch(resolved, None)
    ckpt_path = check_run_dir(cfg, run_dir, report=_print if _is_launching_rank() else None)
    check_resume(cfg, ckpt_path)  # the recorded config against this one (the tokenizer once it is prepared)
    return Launch(resolved, ckpt_path)


def start(cfg: DictConfig, run_dir: Path, launch: Launch, launching: bool) -> tuple[L.Trainer, Task, DataModule]:
    """The data, prepared and checked (said on the launching rank), then model, task and trainer,
    built with the callback that records the run (`trainer.resume_record.ResumeRecord`).

    Raises:
        DataError: data that cannot be trained on, or no batch under trainer.limit_train_batches.
        ConfigError: the config against the one recorded in the run directory (`check_resume`).
    """
    data = prepared_data(cfg, launch.run)
    check_train_batches(cfg, data)
    length = plan_run_length(cfg.trainer.max_steps, data)
    check_not_spent(length, launch.ckpt_path)
    if launching:
        ep = OmegaConf.select(cfg, "strategy.expert_parallel.ep", default=1)
        if (layout := layout_line(launch.run, ep=ep if isinstance(ep, int) else 1)) is not None:
            _print(layout)
        for note in launch.run.notes:
            _print(f"warning: {note}")
        for line in describe(data):
            _print(line)
        if (early := length.launch_line()) is not None:  # what ends the run first
            _print(early)
        if (epochs := epochs_line(data.prepare(), launch.run.global_batch_size, length.planned_steps)) is not None:
            _print(epochs)
        if (warmup := warmup_line(cfg, length.planned_steps)) is not None:
            _print(warmup)
        shape = launch.run.shape
        params = ((p.name, p.shape) for p in shape.params) if shape is not None else ()
        if shape is not None and (muon := muon_line(launch.run.optimizer, params, adapters=launch.run.adapters)):
            _print(muon)
        if (chat := data.chat_format()) is not None:
            _print(chat.line())
        if cfg.model.get("init_from") is not None and (lr := lr_line(cfg)) is not None:
            _print(lr)
    data_fingerprint = data.data_fingerprint()
    dp = launch.run.dims.dp
    overrides = check_resume(cfg, launch.ckpt_path, data.tokenizer, data_fingerprint, dp)  # now with the data
    changes = resume_changes(cfg, launch.ckpt_path)
    if launching:
        for key, (old, new) in changes.items():
            _print(f"resume: {key}: {old!r} -> {new!r} (recorded in {run_dir / RESUMES_FILE})")
        old_max = changes.get("trainer.max_steps", (None, None))[0]
        step = meta_step(launch.ckpt_path) if launch.ckpt_path is not None else None
        if isinstance(old_max, int) and old_max > 0 and step is not None:  # the same data: its old planned length
            old_steps = plan_run_length(old_max, data).planned_steps
            if (reshaped := schedule_line(cfg, step, old_steps, length.planned_steps, old_max)) is not None:
                _print(reshaped)
    # config.yaml and tokenizer.json (what generate builds from) are written once the checkpoint loaded.
    record = ResumeRecord(
        cfg,
        data.tokenizer,
        run_dir,
        overrides,
        data.model_chat_template(),
        changes,
        launch.ckpt_path,
        data_fingerprint,
        dp,
    )
    trainer, task = build_fit(cfg, launch.run, run_dir, data, callbacks=[record])
    return trainer, task, data


def layout_line(run: ResolvedRun, *, ep: int = 1) -> str | None:
    """The mesh a run of more than one rank trains on, as resolved (``strategy=fsdp_tp`` on 2 ranks is
    tp=2 with dp_shard=1, ``hsdp`` on 2 plain data parallel: said, not left to config.yaml), with the
    expert-parallel degree ``ep`` (its ranks borrowed from dp_shard x cp); None for one rank."""
    if run.world_size <= 1:
        return None
    dims = run.dims
    axes = [f"{axis}={getattr(dims, axis)}" for axis in MESH_AXES if getattr(dims, axis) > 1]
    islands = " (local-SGD islands: dp_replicate)" if run.islands else ""
    experts = f"; experts over ep={ep} of them" if ep > 1 else ""
    return f"layout: {run.world_size} ranks, {' x '.join(axes)}{islands}{experts}"


def warmup_line(cfg: DictConfig, planned_steps: int) -> str | None:
    """A warning when the LR warm-up outlasts the run (``scheduler.warmup_steps`` > the planned
    steps): the LR never reaches ``optim.lr`` (step k trains at (k + 1) / warmup_steps of it)."""
    warmup = OmegaConf.select(cfg, "scheduler.warmup_steps", default=None)
    if not isinstance(warmup, int) or warmup <= planned_steps:
        return None
    return (
        f"warning: scheduler.warmup_steps={warmup} is longer than the run's {planned_steps} planned steps: the LR "
        f"is still warming up at the last step ({planned_steps}/{warmup} of optim.lr); lower scheduler.warmup_steps "
        f"(e.g. scheduler.warmup_steps={max(1, planned_steps // 10)})"
    )


def schedule_line(cfg: DictConfig, step: int, old_steps: int, new_steps: int, old_max: int) -> str | None:
    """A warning when a resume's new run length reshapes the decaying learning-rate schedule (plait's
    `trainer.optim.WarmupDecayLR` decays to ``min_lr_ratio`` at the run's last planned step): the lr
    of the first resumed step under the old planned length (``old_steps``, of the run's recorded
    ``trainer.max_steps`` ``old_max`` on the same data) against the new (``new_steps``); None when it
    moves by under 1% (a run its data ends plans the same steps under both)."""
    node = OmegaConf.select(cfg, "scheduler", default=None)
    if node is None or node.get("_target_") != "trainer.optim.WarmupDecayLR":
        return None
    defaults = inspect.signature(WarmupDecayLR).parameters  # the fields a config may leave to the class
    shape = {key: node.get(key, defaults[key].default) for key in ("warmup_steps", "decay", "min_lr_ratio")}
    if shape["decay"] == "constant":
        return None
    before, after = (lr_factor(step, total_steps=total, **shape) for total in (old_steps, new_steps))
    if abs(after - before) <= 0.01 * before:
        return None
    lr = float(cfg.optim.lr)
    why = (
        f"to keep the old course, resume with trainer.max_steps={old_max}"
        if new_steps < old_steps
        else "one schedule spans the run's planned steps, so a longer run stretches its decay"
    )
    return (
        f"warning: the {shape['decay']} schedule now decays over {new_steps} steps, not {old_steps}: step {step + 1} "
        f"trains at lr {after * lr:.3g} where the run was at {before * lr:.3g} (x{after / before:.2f}); {why}"
    )


def check_not_spent(length: RunLength, ckpt_path: Path | None) -> None:
    """Refuses a resume from a checkpoint at or past the step where the run's data ends, of a run
    that finished there (its ``summary.json`` says the data ended it after those steps): it would
    train nothing (a run its data ended, resumed with more ``trainer.max_steps``). A run that saved
    that step but died before its end (no summary, or one an exception wrote) resumes, to do what
    ends a run (the export, the summary).

    Raises:
        ConfigError: naming what ends the data and the new run that trains on from these weights.
    """
    step = meta_step(ckpt_path) if ckpt_path is not None else None
    if step is None or length.ends_by != DATA_EXHAUSTED or step < length.planned_steps:
        return
    summary = RunDir.of_checkpoint(ckpt_path).summary
    try:
        ended = json.loads(summary.read_text())
        finished = ended.get("stopped_by") == DATA_EXHAUSTED and ended.get("steps", 0) >= step
    except (OSError, ValueError, AttributeError):  # no summary (the run died first), or not one plait wrote
        finished = False
    if not finished:
        return
    raise ConfigError(
        [
            f"{ckpt_path} is at step {step}, where the run's data ends ({length.reason}): resuming trains nothing "
            f"more, whatever trainer.max_steps; the data cannot change on a resume, so to train on, start a new "
            f"run_dir from these weights with the data lengthened (model.init_from={ckpt_path} and the setting above)"
        ]
    )


def run(cfg: DictConfig, launch: Launch | None = None) -> None:
    """Trains the composed config ``cfg`` in the current Hydra job's output directory (or, for a
    budget search, hands the directory to it: `trainer.budget.driver`).

    Args:
        launch: what the launching process has already checked (`check_launch`) for this very
            config; None checks it here (child ranks, the jobs of a multirun sweep).
    """
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    launching = _is_launching_rank()
    fresh = not any(run_dir.iterdir())
    with refused_start(run_dir, launching, fresh):
        launch = check_launch(cfg, run_dir) if launch is None else launch
        if is_search(cfg):  # budget=msft, plait rest: a driver that fits runs of its own in run_dir
            try:
                run_search(cfg, run_dir, launch.run, say=_print if launching else None)
            except DriverError as err:
                print(f"plait: error: {err}", file=sys.stderr)
                raise SystemExit(1) from None
            return
        if launches_groups(cfg):  # strategy=ft: this process starts the replica groups and waits for them
            raise SystemExit(run_replica_groups(cfg, run_dir, say=_print))
        trainer, task, data = start(cfg, run_dir, launch, launching)
    ckpt_path = launch.ckpt_path
    try:
        with nothing_left_untrained(run_dir, fresh, trainer):
            trainer.fit(task, datamodule=data, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=True)
    except (NonFiniteError, NonFiniteStateError) as err:  # the run diverged: exit 3, the message says why
        if launching:
            write_line(f"plait: error: {err}")
        raise SystemExit(3) from None
    except RewardError as err:  # a reward function of the data failed on the run's completions: exit 2
        write_line(f"plait: error: {err}")
        raise SystemExit(2) from None
    except CheckpointError as err:  # the checkpoint to resume from refused to load, or a save failed to write: exit 2
        if launching:
            write_line(f"plait: error: {err}")
        raise SystemExit(2) from None
    except Exception:
        heartbeat = trainer.strategy.heartbeat
        lost = heartbeat.lost_ranks() if heartbeat is not None else []
        if not lost:
            raise
        # A peer died: one line instead of the backend's traceback; os._exit skips gloo's threads,
        # which abort a normal exit after a failed collective.
        print(heartbeat.lost_line(lost), file=sys.stderr, flush=True)
        os._exit(ABORT_EXIT)
    if trainer.is_global_zero and task.nonfinite.skipped:  # train.nonfinite=skip went on: say so
        print(
            f"plait: warning: {task.nonfinite.skipped} of {trainer.global_step} steps skipped their update "
            f"({task.nonfinite.counts()}; train.nonfinite={task.nonfinite.policy}, summary.json skipped_steps)",
            file=sys.stderr,
        )
    if trainer.is_global_zero:
        summary = RunDir(run_dir).summary
        print(f"plait: run directory {run_dir}" + (f"\n{summary.read_text()}" if summary.exists() else ""))
    # The next job of a --multirun sweep must launch its own processes again.
    for key in LAUNCH_ENV if launching else ():
        os.environ.pop(key, None)
