"""plait's launcher of torchft replica groups on one machine (strategy=ft): the Lighthouse, one plait
world per group, and a new process for a group that dies.

``plait pretrain strategy=ft trainer.devices=2`` (no ``strategy.fault_tolerance.replica_group``)
starts here: a torchft Lighthouse in this process, then ``num_replica_groups`` child commands of the
same job, each with its group's index, the Lighthouse's address and its own run directory
(``<run_dir>/group<g>``; each group is a whole plait world of ``trainer.devices`` processes). A group
that is killed (or loses a rank) is started again, up to ``max_restarts`` times, in
``<run_dir>/group<g>.restart<k>``: it takes a healthy group's state at its first quorum and rejoins
(`strategies.fault_tolerance`); the others train on meanwhile. A group that fails on bad input
(exit 2) or divergence (exit 3) would fail again: it is not restarted.

Several machines: start a Lighthouse yourself (``torchft_lighthouse --min_replicas 1``) and on each
machine one group with ``strategy.fault_tolerance.replica_group=<g>`` and
``strategy.fault_tolerance.lighthouse=http://<host>:<port>`` (or ``$TORCHFT_LIGHTHOUSE``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from strategies.runtime.launch import LAUNCH_ENV, child_command

# bad input and divergence fail the same way again; 130 and 143: stopped by a signal on purpose (Ctrl-C, SIGTERM)
NOT_RESTARTED = (2, 3, 130, 143)


def launches_groups(cfg: Any) -> bool:
    """Whether this command is the launcher of replica groups (fault tolerance on, no group given)."""
    node = cfg.strategy.get("fault_tolerance")
    return node is not None and node.get("replica_group") is None


def group_problems(cfg: Any) -> list[str]:
    """What a run of replica groups (the launcher or one group) cannot take yet, each naming the fix:
    ``resume`` (torchft's step is not in the checkpoints, so groups resumed at different steps would
    not recover from each other) and ``train.nonfinite=rollback`` (each group would reload its own
    checkpoint, and a restarted group has none from before it joined)."""
    problems = []
    if cfg.get("resume") is not None:
        problems.append(
            f"resume={cfg.resume} with strategy.fault_tolerance: restarting every replica group from its checkpoints "
            "is not built yet (a group that dies is restarted and recovers from the others while they train); start "
            "a fresh run, or resume one group's directory (<run_dir>/group<g>) without strategy.fault_tolerance"
        )
    if OmegaConf.select(cfg, "train.nonfinite") == "rollback":
        problems.append(
            "train.nonfinite=rollback with strategy.fault_tolerance: the groups would reload different checkpoints; "
            "use train.nonfinite=skip or stop"
        )
    return problems


def gpu_problems(cfg: Any, visible: int) -> list[str]:
    """Why the launcher cannot give every group GPUs of its own ([] if it can): ``visible`` GPUs
    for ``num_replica_groups`` x ``trainer.devices``."""
    devices, groups = cfg.trainer.devices, int(cfg.strategy.fault_tolerance.num_replica_groups)
    if str(cfg.trainer.accelerator) not in ("gpu", "cuda") or not isinstance(devices, int):
        return []
    if groups * devices > visible:
        return [
            f"strategy.fault_tolerance.num_replica_groups={groups} x trainer.devices={devices} needs {groups * devices} "
            f"GPUs, {visible} are visible; use trainer.devices={max(1, visible // groups)} or fewer groups"
        ]
    return []


def run_replica_groups(cfg: Any, run_dir: Path, say: Callable[[str], None] = print) -> int:
    """Starts the Lighthouse and the groups (each in a session of its own, on GPUs of its own),
    restarts those that die, and waits for all of them. SIGTERM or Ctrl-C reaches every group as
    SIGTERM (each saves a checkpoint and stops), then the launcher ends.

    Returns:
        The exit code: 0 when a group trained to the end (the lost groups are named), else the
        code of the last group to fail.
    """
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse logs every quorum at info
    from torchft._torchft import LighthouseServer  # lazily: torchft is not loaded for runs without replica groups

    node = cfg.strategy.fault_tolerance
    groups, max_restarts, devices = int(node.num_replica_groups), int(node.max_restarts), cfg.trainer.devices
    gpus = str(cfg.trainer.accelerator) in ("gpu", "cuda")  # each group gets its own block of the visible GPUs
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=int(node.join_timeout_s * 1000), heartbeat_timeout_ms=5000
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}  # each group is a world of its own

    def start(g: int, attempt: int) -> subprocess.Popen:
        group_dir = run_dir / (f"group{g}" if attempt == 0 else f"group{g}.restart{attempt}")
        extra = [
            f"strategy.fault_tolerance.replica_group={g}",
            f"strategy.fault_tolerance.lighthouse={server.address()}",
        ]
        if attempt > 0:
            extra.append("strategy.fault_tolerance.restarted=true")  # recovers from a healthy group
        if g > 0:
            extra.append("trainer.enable_progress_bar=false")  # one bar on the terminal
        group_env = dict(env, CUDA_VISIBLE_DEVICES=",".join(ids[g * devices : (g + 1) * devices])) if gpus else env
        # a session of its own: the group's ranks are stopped together (os.killpg), not only its rank 0
        return subprocess.Popen(
            child_command(0, run_dir=str(group_dir), extra=extra), env=group_env, start_new_session=True
        )

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # the finally below forwards it to the groups

    previous = signal.signal(signal.SIGTERM, stop)
    say(f"{groups} replica groups (torchft Lighthouse {server.address()}); their runs: {run_dir}/group<g>")
    procs = {g: start(g, 0) for g in range(groups)}
    attempts = dict.fromkeys(range(groups), 0)
    codes: dict[int, int] = {}
    try:
        while len(codes) < groups:
            time.sleep(0.5)
            for g, proc in procs.items():
                if g in codes or (code := proc.poll()) is None:
                    continue
                if code != 0 and code not in NOT_RESTARTED and attempts[g] < max_restarts and not _all_done(codes):
                    attempts[g] += 1
                    say(f"replica group {g} ended (exit {code}); restart {attempts[g]} of {max_restarts}")
                    procs[g] = start(g, attempts[g])
                else:
                    codes[g] = code
    finally:
        _stop_groups([proc for proc in procs.values() if proc.poll() is None])
        server.shutdown()
        signal.signal(signal.SIGTERM, previous)
    lost = {g: c for g, c in codes.items() if c != 0}
    if len(lost) == groups:
        print(f"plait: error: every replica group failed (exit codes {lost})", file=sys.stderr)
        return next(reversed(lost.values()))
    if lost:
        print(
            f"plait: warning: replica groups {sorted(lost)} did not finish (exit codes {lost}); the others did",
            file=sys.stderr,
        )
    return 0


def _stop_groups(procs: list[subprocess.Popen], grace_s: float = 60.0) -> None:
    """SIGTERM to every rank of each group (its session), SIGKILL to what is left after ``grace_s``."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _all_done(codes: dict[int, int]) -> bool:
    """Whether a group already trained to the end (a restart would find no one to recover from)."""
    return any(code == 0 for code in codes.values())
