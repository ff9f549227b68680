"""A run directory may come from anywhere: nothing planted in it, or in the folder a command starts
in, runs. For every command that reads a run directory or starts in one (resume, model.init_from,
plan with model.init_from, generate, chat, export, merge, compare), with the current folder a work
folder and the planted run directory itself, and as the ``plait`` script and as ``python -m trainer.cli``:

- modules named like the optional dependencies libraries import when present (`LAZY_MODULES`) and
  a ``hydra_plugins/`` package (Hydra imports every module under it) in the current folder;
- a ``_target_`` in every node of the run's ``config.yaml`` (`NODES`), the model's nested
  ``rope_scaling`` on its own (Hydra builds nested targets first).

Each payload creates a marker file named after it when it runs; none may appear, and each command
either works or refuses with one ``plait: error:`` line naming the target (exit 2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import CLI_TINY
from omegaconf import OmegaConf

from trainer.user_path import USER_PATH_ENV

# Optional modules that torch, Lightning, Hydra and their dependencies try to import during these
# commands when they are absent (found with a sys.meta_path finder recording the failed lookups).
LAZY_MODULES = (
    "pynvml",
    "opt_einsum",
    "torchcomms",
    "triton",
    "colorama",
    "zstandard",
    "tree",
    "wcwidth",
    "scipy",
    "sentencepiece",
    "torchvision",
    "hypothesis",
    "xarray",
    "onnx",
    "pydot",
    "lz4",
    "brotli",
    "h2",
    "trio",
    "mpi4py",
)
# config.yaml nodes that get a payload: (dotted key of the new node, what the test calls it).
NODES = {
    "model": ["model.rope_scaling"],
    "other": ["data.payload", "objective.payload", "optim.payload", "scheduler.payload", "strategy.payload", "callbacks.payload"],
}  # fmt: skip
TRAINED = (*CLI_TINY, "trainer.max_steps=2", "logger=none", "~callbacks.plots")


def _absent(name: str) -> bool:
    """Whether ``name`` is not installed: a module of that name in a searched folder would be the one imported."""
    import importlib.util

    return importlib.util.find_spec(name) is None


def plant_modules(folder: Path, markers: Path) -> None:
    """Writes `LAZY_MODULES` (the absent ones) and a ``hydra_plugins`` package into ``folder``: each
    creates ``markers/<name>`` when imported (a module then says it is not there, as the real absence would)."""
    for name in filter(_absent, LAZY_MODULES):
        (folder / f"{name}.py").write_text(
            f"open({str(markers / name)!r}, 'w').close()\nraise ModuleNotFoundError({name!r}, name={name!r})\n"
        )
    (folder / "hydra_plugins" / "planted").mkdir(parents=True)
    (folder / "hydra_plugins" / "planted" / "__init__.py").write_text(
        f"open({str(markers / 'hydra_plugins')!r}, 'w').close()\n"
    )


def plant_targets(run: Path, markers: Path, keys: list[str]) -> None:
    """Adds to ``run/config.yaml`` a node at each of ``keys`` whose ``_target_`` creates ``markers/<key>``
    when built (``builtins.open``: any callable would do; Hydra's own policy lets this one through)."""
    cfg = OmegaConf.load(run / "config.yaml")
    for key in keys:
        OmegaConf.update(
            cfg, key, {"_target_": "builtins.open", "file": str(markers / key), "mode": "w"}, force_add=True
        )
    OmegaConf.save(cfg, run / "config.yaml")


@dataclass(frozen=True)
class Planted:
    markers: Path  # where a payload that runs leaves its marker
    work: Path  # a folder with the planted modules, to start commands in
    runs: dict[str, Path]  # "model" / "other": the trained run with modules and its NODES planted
    out: Path  # where commands write (one sub-folder per test)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Planted:
    root = tmp_path_factory.mktemp("payloads")
    trained = root / "trained"
    result = _plait("pretrain", *TRAINED, f"run_dir={trained}", cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    markers, work, out = root / "markers", root / "work", root / "out"
    for folder in (markers, work, out):
        folder.mkdir()
    plant_modules(work, markers)
    runs = {}
    for variant, keys in NODES.items():
        runs[variant] = shutil.copytree(trained, root / variant, symlinks=True)
        plant_modules(runs[variant], markers)
        plant_targets(runs[variant], markers, keys)
    return Planted(markers, work, runs, out)


def _plait(*args: str, cwd: Path, module: bool = False, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``plait *args`` started in ``cwd``, without PYTHONPATH or PLAIT_USER_PATH in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", USER_PATH_ENV)}
    command = [sys.executable, "-m", "trainer.cli"] if module else [str(Path(sys.executable).with_name("plait"))]
    return subprocess.run(
        [*command, *args],
        cwd=cwd,
        env=env,
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=300,
    )


def _command(name: str, run: str, out: Path) -> tuple[list[str], str | None]:
    """(the arguments of command ``name`` on the run ``run``, its stdin)."""
    sampling = ["max_new_tokens=2", "temperature=0"]
    return {
        "generate": (["generate", f"ckpt={run}", "prompt=To be", *sampling], None),
        "chat": (["chat", f"ckpt={run}", *sampling], "hello\n"),
        "export": (["export", f"ckpt={run}", f"out={out / 'hf'}"], None),
        "merge": (["merge", f"base={run}", f"deltas=[{run}]", f"out={out / 'merged'}"], None),
        "compare": (["compare", run, f"out={out / 'compare.png'}"], None),
        "plan": (["plan", f"model.init_from={run}", "cluster=cpu"], None),  # validates the run's model, as a run does
        # the run's architecture is taken (no model=...); a fresh run of one step
        "init_from": (
            [
                "pretrain",
                *(o for o in TRAINED if o != "model=nano"),
                "trainer.max_steps=1",
                f"model.init_from={run}",
                f"run_dir={out / 'init'}",
            ],
            None,
        ),
        "resume": (["pretrain", *TRAINED, "trainer.max_steps=3", f"run_dir={run}", "resume=last"], None),
    }[name]


@pytest.mark.parametrize("module", [False, True], ids=["script", "python-m"])
def test_compare_started_in_a_planted_run_runs_nothing(tmp_path: Path, module: bool) -> None:
    """No training needed: a run directory of a config.yaml (payloads in every node), a metrics.csv and
    the planted modules; ``plait compare .`` in it composes with Hydra (which imports hydra_plugins)."""
    from trainer.compose import compose

    markers, run = tmp_path / "markers", tmp_path / "run"
    markers.mkdir()
    run.mkdir()
    OmegaConf.save(compose("pretrain", ["model=nano"]), run / "config.yaml", resolve=True)
    plant_targets(run, markers, [*NODES["model"], *NODES["other"]])
    plant_modules(run, markers)
    (run / "metrics.csv").write_text("step,train/loss,val/loss\n0,,8.3\n1,8.2,\n2,8.1,8.0\n")
    result = _plait("compare", ".", f"out={tmp_path / 'compare.png'}", cwd=run, module=module)
    assert sorted(os.listdir(markers)) == [], result.stderr
    assert result.returncode == 0 and (tmp_path / "compare.png").is_file(), result.stdout + result.stderr


COMMANDS = ("generate", "chat", "export", "merge", "compare", "plan", "init_from", "resume")
BUILDS_THE_MODEL = {"generate", "chat", "export", "merge", "plan", "init_from"}
# (the config.yaml variant, where the command starts, python -m or the script)
CASES = [("other", "work", False), ("other", "run", True), ("model", "run", False)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,cwd,module", CASES, ids=[f"{v}-nodes-cwd={c}{'-python-m' if m else ''}" for v, c, m in CASES]
)
@pytest.mark.parametrize("name", COMMANDS)
def test_no_payload_runs(planted: Planted, tmp_path: Path, name: str, variant: str, cwd: str, module: bool) -> None:
    run = planted.runs[variant]
    if name == "resume":  # it trains on in the run directory: a copy of its own
        run = shutil.copytree(run, tmp_path / "run", symlinks=True)
    start = planted.work if cwd == "work" else run
    args, stdin = _command(name, "." if start == run else str(run), tmp_path)
    for marker in planted.markers.iterdir():  # left by an earlier failure: this test counts its own
        marker.unlink()
    result = _plait(*args, cwd=start, module=module, stdin=stdin)
    ran = sorted(os.listdir(planted.markers))
    assert ran == [], f"planted code ran: {ran}\n{result.stderr[-3000:]}"
    output = f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    if variant == "model" and name in BUILDS_THE_MODEL:
        assert result.returncode == 2, output
        assert "Traceback" not in result.stderr, output
        assert [line for line in result.stderr.splitlines() if line.startswith("plait: error:")], output
        assert len([line for line in result.stderr.splitlines() if line.startswith("plait: error:")]) == 1, output
        assert "model.rope_scaling._target_=builtins.open is in Python's standard library" in result.stderr, output
        assert not (tmp_path / "init").exists()  # a refused run writes no run directory
    else:
        assert result.returncode == 0, output
