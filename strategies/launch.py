"""Process launchers: one Hydra job per launch from the CLI, and fork for tests.

Lightning's subprocess launcher re-runs ``sys.argv`` in each child. Under Hydra that breaks two
ways: a child of a ``--multirun`` parent runs the
whole sweep again, and a child computes its own timestamped run directory. `HydraJobLauncher`
starts each child for *this* job only: the config selection, this job's resolved overrides and the
parent's run directory. `ForkLauncher` runs ranks as forked processes inside pytest without
shipping weights back (the stock launcher pickles rank 0's state dict, which fails on DTensors).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

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
            problems.append(f"trainer.accelerator={accelerator} but no CUDA device is visible; use trainer.accelerator=cpu")
        elif devices > visible and not any(key in environ for key in (*MULTI_NODE_ENV, "LOCAL_RANK")):
            problems.append(
                f"trainer.devices={devices} but {visible} GPU(s) are visible on this node; use trainer.devices={visible}"
            )
    return problems


def child_command(local_rank: int) -> list[str]:
    """The command that runs rank ``local_rank`` of the current Hydra job (no sweep)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    argv, selection = sys.argv[1:], []
    for i, arg in enumerate(argv):
        if arg.startswith(_CONFIG_FLAGS):
            selection += [arg] if "=" in arg else [arg, argv[i + 1]]
    run_dir = hydra_cfg.runtime.output_dir
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("run_dir=", "hydra."))]
    # Hydra files hydra.* overrides apart from the task's; the child needs the conf/ search path.
    overrides += [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath=")]
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    exe = [sys.executable, "-m", spec.name] if spec is not None else [sys.executable, os.path.abspath(sys.argv[0])]
    return exe + selection + overrides + [
        f"run_dir={run_dir}",
        f"hydra.run.dir={run_dir}",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ]


class HydraJobLauncher(_SubprocessScriptLauncher):
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
    from hydra.core.hydra_config import HydraConfig

    cls = HydraJobLauncher if HydraConfig.initialized() else _SubprocessScriptLauncher
    return cls(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
