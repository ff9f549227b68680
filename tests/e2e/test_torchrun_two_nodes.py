"""Two "nodes" on this machine train one run, as on a cluster (README, "Beyond one machine"):
started by torchrun, or by a mocked srun (SLURM's variables). Lightning finds the
cluster environment, plait starts no processes of its own, global rank 0 alone writes the run
directory, and the run equals one process training the same config."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import CLI_TINY, plait, train_rows

from strategies.checkpoint.dcp import is_checkpoint

STEPS = 3
Start = Callable[[int, int, list[str]], tuple[list[str], dict[str, str]]]
TINY_3 = (*(o for o in CLI_TINY if not o.startswith("trainer.max_steps=")), f"trainer.max_steps={STEPS}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(node: int, port: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """``torchrun -m trainer.cli *args`` on node ``node`` of 2, 1 process per node, static rendezvous."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        "trainer.cli",
        *args,
    ]
    return command, {}


def _srun(node: int, port: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """What ``srun --nodes 2 --ntasks-per-node 1 plait *args`` starts on node ``node``: its variables."""
    env = {
        "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0", "SLURM_NODEID": str(node), "SLURM_JOB_NAME": "plait-test",
        "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(port),  # Lightning's default port comes from the job id
    }  # fmt: skip
    return [sys.executable, "-m", "trainer.cli", *args], env


def _two_nodes(start: Start, args: list[str], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Runs ``start(node, port, args)``'s command for nodes 0 and 1 at once; their results by node."""
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    procs = []
    for node in range(2):
        command, env = start(node, port, args)
        procs.append(
            subprocess.Popen(
                command,
                env={**base, **env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    """metrics.csv rows of the same global batch in one process (two micro-batches instead of two replicas)."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    result = plait("pretrain", *TINY_3, "trainer.devices=1", f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-5000:]
    return train_rows(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("start", [_torchrun, _srun], ids=["torchrun", "slurm"])
def test_two_nodes_equal_one_process(start: Start, single_process: dict[int, dict[str, str]], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Replicas across the nodes: strategy.dp_shard would be the accelerators of one node.
    layout = [
        "strategy=hsdp",
        "strategy.dp_shard=1",
        "strategy.dp_replicate=2",
        "trainer.num_nodes=2",
        "trainer.devices=1",
    ]
    nodes = _two_nodes(start, ["pretrain", *TINY_3, *layout, f"run_dir={run_dir}"])
    for node, result in enumerate(nodes):
        assert result.returncode == 0, (
            f"node {node}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )

    # One run directory, written once: global rank 0 prints it, the other node only trains.
    assert [f"plait: run directory {run_dir}" in r.stdout for r in nodes] == [True, False]
    for name in ("config.yaml", "tokenizer.json", "metrics.csv", "summary.json"):
        assert (run_dir / name).is_file(), f"{name} missing from {sorted(p.name for p in run_dir.iterdir())}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    step_dir = run_dir / "checkpoints" / f"step_{STEPS:07d}"
    assert is_checkpoint(step_dir)
    assert sorted(p.name for p in (step_dir / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]

    two_nodes, one = train_rows(run_dir), single_process
    assert sorted(two_nodes) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        assert float(two_nodes[step]["train/loss"]) == pytest.approx(float(one[step]["train/loss"]), rel=1e-5)
