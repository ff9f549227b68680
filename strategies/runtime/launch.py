"""Process launchers: one Hydra job per launch from the CLI, and fork for tests.

Lightning's subprocess launcher re-runs ``sys.argv`` in each child. Under Hydra that breaks two
ways: a child of a ``--multirun`` parent runs the
whole sweep again, and a child computes its own timestamped run directory. `HydraJobLauncher`
starts each child for *this* job only: the config selection, this job's resolved overrides and the
parent's run directory. `ForkLauncher` runs ranks as forked processes inside pytest without
shipping weights back (the stock launcher pickles rank 0's state dict, which fails on DTensors).

Lightning's launcher also watches the children and, as soon as one exits non-zero, SIGKILLs every
rank, itself included: the survivors die (exit -9) before they can say which rank was lost.
`RankObserver` gives them ``grace_s`` to end on their own (plait's lost-rank line, exit 4) first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from strategies.runtime.watchdog import ABORT_EXIT

_CONFIG_FLAGS = ("--config-path", "--config-name", "--config-dir", "-cp", "-cn", "-cd")
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


# Variables of a launcher that starts plait on every node itself: SLURM's srun, torchrun, or a
# manual launch that sets NODE_RANK on each node (Lightning's environments read the same ones).
MULTI_NODE_ENV = ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "NODE_RANK")


def launch_problems(accelerator: str, devices: int, num_nodes: int, environ: dict[str, str] | None = None) -> list[str]:
    """Why no launcher can start ``num_nodes`` x ``devices`` processes here ([] if one can).

    plait starts the processes of one node itself; more nodes need a launcher on each, and the
    processes plait starts need that many visible GPUs (an external launcher may show each
    process its own). Checked at launch (`trainer.run.check_launch`), not by validate: a
    multi-node config is planned and validated anywhere.
    """
    environ = os.environ if environ is None else environ
    problems = []
    if num_nodes > 1 and not any(key in environ for key in MULTI_NODE_ENV):
        problems.append(
            f"trainer.num_nodes={num_nodes} needs a launcher that starts plait on every node (srun under SLURM, "
            f"torchrun --nnodes={num_nodes}, or NODE_RANK and MASTER_ADDR set on each node); on one machine use "
            "trainer.num_nodes=1"
        )
    if accelerator in ("gpu", "cuda"):
        visible = torch.cuda.device_count()
        if visible == 0:
            problems.append(
                f"trainer.accelerator={accelerator} but no CUDA device is visible; use trainer.accelerator=cpu"
            )
        elif devices > visible and not any(key in environ for key in (*MULTI_NODE_ENV, "LOCAL_RANK")):
            problems.append(
                f"trainer.devices={devices} but {visible} GPU(s) are visible on this node; use trainer.devices={visible}"
            )
    return problems


def child_command(local_rank: int, *, run_dir: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The command that runs rank ``local_rank`` of the current Hydra job (no sweep), in ``run_dir``
    (None: the job's) with the ``extra`` overrides (a replica group's, `trainer.replica_groups`)."""
    hydra_cfg = HydraConfig.get()
    argv, selection = sys.argv[1:], []
    for i, arg in enumerate(argv):
        if arg.startswith(_CONFIG_FLAGS):
            selection += [arg] if "=" in arg else [arg, argv[i + 1]]
    run_dir = run_dir or hydra_cfg.runtime.output_dir
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("run_dir=", "hydra."))]
    # Hydra files hydra.* overrides apart from the task's; the child needs the conf/ search path.
    overrides += [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath=")]
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    exe = [sys.executable, "-m", spec.name] if spec is not None else [sys.executable, os.path.abspath(sys.argv[0])]
    return (
        exe
        + selection
        + overrides
        + list(extra)
        + [
            f"run_dir={run_dir}",
            f"hydra.run.dir={run_dir}",
            f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
            "hydra.output_subdir=null",
        ]
    )


class RankObserver(threading.Thread):
    """Watches rank 0's child ranks; after one exits non-zero, gives every rank ``grace_s`` to end
    on its own (a rank that fails with a plait error ends all ranks with that error and its exit
    code), then ends what is left: the children with SIGKILL, this process (rank 0) with one
    line naming the lost rank and exit `ABORT_EXIT`. (A survivor blocked in a collective with the
    lost rank may wait for the backend's timeout: the observer does not.)

    Args:
        procs: the child ranks' processes (``procs[i]`` is local rank ``i + 1``).
        grace_s: seconds the ranks get to end on their own.
        step: the step this process is in (for the line), or None.
        poll_s: seconds between polls.
        end: ends this process (``os._exit``: its main thread may be blocked in a collective).
    """

    def __init__(
        self,
        procs: list[subprocess.Popen],
        *,
        grace_s: float,
        step: Callable[[], int | None] = lambda: None,
        poll_s: float = 1.0,
        end: Callable[[int], None] = os._exit,
    ) -> None:
        super().__init__(daemon=True, name="plait-rank-observer")
        self.procs, self.grace_s, self.step, self.poll_s, self.end = procs, grace_s, step, poll_s, end

    @override
    def run(self) -> None:
        failed = None
        while failed is None:
            time.sleep(self.poll_s)
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes):
                return
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
        time.sleep(self.grace_s)  # this process is a survivor too: when it ends sooner, so does this thread
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        print(self.lost_line(failed + 1, self.procs[failed].returncode), file=sys.stderr, flush=True)
        self.end(ABORT_EXIT)

    def lost_line(self, rank: int, code: int) -> str:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        step = self.step()
        at = f" at step {step}" if step is not None else ""
        return (
            f"plait: error: lost rank {rank}{at} (its process {how}); rank 0 stops the run (exit {ABORT_EXIT}). Continue it "
            "with resume=last"
        )


class SubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with `RankObserver` in place of its child-process observer.

    Attributes:
        grace_s: seconds the ranks get to end on their own after one exited non-zero.
        step: the step rank 0 is in, for the lost-rank line.
    """

    grace_s: float = 15.0
    step: Callable[[], int | None] = staticmethod(lambda: None)

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            RankObserver(self.procs, grace_s=self.grace_s, step=self.step).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class HydraJobLauncher(SubprocessLauncher):
    """Starts ranks 1..N-1 of the current Hydra job as subprocesses of rank 0."""

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env = dict(os.environ, LOCAL_RANK=str(local_rank))
            self.procs.append(subprocess.Popen(child_command(local_rank), env=env))


class ForkLauncher(_MultiProcessingLauncher):
    """Forks the ranks (tests). Rank 0 sends back ``trainer.lightning_module.history`` only.

    The history goes through a file, not the result queue: Lightning joins the workers before it
    reads the queue, so anything larger than a pipe buffer would deadlock.
    """

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy, start_method="fork")
        handle, self._history_file = tempfile.mkstemp(prefix="plait-history-", suffix=".pt")
        os.close(handle)

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        return _WorkerOutput(None, None, trainer.state, results, self.get_extra_results(trainer))

    @override
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        torch.save(list(getattr(trainer.lightning_module, "history", [])), self._history_file)
        return extra

    @override
    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        trainer.lightning_module.history = torch.load(self._history_file, weights_only=True)
        os.unlink(self._history_file)


def launcher_for(strategy: Any, kind: str) -> Any:
    """The launcher of ``strategy`` (a `MeshStrategy`): "fork" forks this process (tests);
    "subprocess" starts one child per rank, inside a Hydra job re-running that job
    (`HydraJobLauncher`), outside one (a user's own script) re-running argv as Lightning does."""
    if kind == "fork":
        return ForkLauncher(strategy)
    cls = HydraJobLauncher if HydraConfig.initialized() else SubprocessLauncher
    launcher = cls(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    heartbeat = getattr(strategy, "heartbeat", None)
    if heartbeat is not None:
        # Time for a rank that failed with a plait error to end the others with it (`Heartbeat.lost_ranks` waits 2 intervals).
        launcher.grace_s = 2 * heartbeat.interval_s + 5.0
        launcher.step = lambda: heartbeat.step
    return launcher
