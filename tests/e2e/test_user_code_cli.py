"""A user's own code: imported only from a folder the user names (``plait --user-path DIR`` or
``PLAIT_USER_PATH``), never from the current folder; a file there named like one of plait's packages
(trainer.py) does not shadow it; the ranks plait starts see the same folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import CLI_TINY

from trainer.user_path import USER_PATH_ENV

MY_ADAM = "optim._target_=my_pkg.opt.MyAdam"
BAD_STEPS = "trainer.max_steps=abc"  # the one problem left when my_pkg imports: nothing trains, nothing is written


def _plait(
    *args: str, cwd: Path, module: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The console script, as a user runs it, or ``python -m trainer.cli`` (which puts the folder
    first on the path itself); the environment without PYTHONPATH or PLAIT_USER_PATH unless given."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", USER_PATH_ENV)}
    command = [sys.executable, "-m", "trainer.cli"] if module else [str(Path(sys.executable).with_name("plait"))]
    return subprocess.run(
        [*command, *args],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def _user_folder(folder: Path, trainer_py: bool = True) -> Path:
    """``folder`` with a package of the user's (my_pkg: an optimizer subclass) and files named like
    plait's packages that must never be imported (no trainer.py for ``python -m trainer.cli``: Python
    looks for the package it runs in the current folder before plait starts, README "Your own model")."""
    folder.mkdir(exist_ok=True)
    if trainer_py:
        (folder / "trainer.py").write_text('raise SystemExit("the user\'s trainer.py was imported")\n')
    (folder / "strategies.py").write_text('raise SystemExit("the user\'s strategies.py was imported")\n')
    (folder / "my_pkg").mkdir()
    (folder / "my_pkg" / "__init__.py").write_text("")
    (folder / "my_pkg" / "opt.py").write_text("import torch\n\nclass MyAdam(torch.optim.AdamW):\n    pass\n")
    return folder


def _problems(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 2, result.stdout + result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("  - ")]


@pytest.mark.parametrize("module", [False, True], ids=["script", "python-m"])
def test_the_current_folder_is_not_searched(tmp_path: Path, module: bool) -> None:
    _user_folder(tmp_path, trainer_py=not module)
    help_ = _plait("--help", cwd=tmp_path, module=module)
    assert help_.returncode == 0 and "--user-path" in help_.stdout, help_.stdout + help_.stderr
    problems = _problems(_plait("pretrain", MY_ADAM, BAD_STEPS, cwd=tmp_path, module=module))
    assert len(problems) == 2 and "my_pkg.opt.MyAdam cannot be imported" in problems[1], problems
    assert "plait --user-path DIR" in problems[1]  # the message names the opt-in
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "my_pkg",
        "strategies.py",
        *(["trainer.py"] if not module else []),
    ]


@pytest.mark.parametrize("how", ["flag", "env"])  # the flag's other spellings: tests/unit/test_user_path.py
def test_a_named_folder_imports_and_shadows_nothing(tmp_path: Path, how: str) -> None:
    user = _user_folder(tmp_path / "code")
    work = tmp_path / "work"
    work.mkdir()
    args, env = {
        "flag": (["pretrain", MY_ADAM, "--user-path", "../code", BAD_STEPS], None),  # relative to the current folder
        "env": (["pretrain", MY_ADAM, BAD_STEPS], {USER_PATH_ENV: str(user)}),
    }[how]
    # validate imports the user's optimizer class (else: "cannot be imported"); the one problem left is
    # the deliberate bad value.
    assert _problems(_plait(*args, cwd=work, env=env)) == ["  - trainer.max_steps='abc' must be int"]
    assert sorted(p.name for p in work.iterdir()) == []


def test_a_bad_user_path_is_one_error_line(tmp_path: Path) -> None:
    for args, env, named in [
        (["--user-path", "nowhere", "pretrain"], None, "--user-path nowhere: nowhere is not a directory"),
        (["pretrain"], {USER_PATH_ENV: "nowhere"}, f"{USER_PATH_ENV}=nowhere: nowhere is not a directory"),
        (["pretrain", "--user-path"], None, "--user-path needs a folder"),
    ]:
        result = _plait(*args, cwd=tmp_path, env=env)
        assert result.returncode == 2 and result.stderr.startswith(f"plait: error: {named}"), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_ranks_plait_starts_import_from_the_named_folder(tmp_path: Path) -> None:
    """2 ranks (rank 1 a child process that re-runs the command without ``--user-path``): the
    user's strategy subclass is built in both, and each writes its rank to the user's folder."""
    user = tmp_path / "code"
    (user / "my_pkg").mkdir(parents=True)
    (user / "my_pkg" / "__init__.py").write_text("")
    (user / "my_pkg" / "strategy.py").write_text(
        "from pathlib import Path\n"
        "from strategies.mesh import MeshStrategy\n\n"
        "class MarkingStrategy(MeshStrategy):\n"
        "    def parallelize(self, model):\n"
        "        (Path(__file__).parent / f'rank{self.global_rank}').touch()\n"
        "        super().parallelize(model)\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    result = _plait(
        "--user-path",
        str(user),
        "pretrain",
        *CLI_TINY,
        "trainer.max_steps=1",
        "logger=none",
        "~callbacks.plots",
        "strategy=ddp",
        "trainer.devices=2",
        "strategy._target_=my_pkg.strategy.MarkingStrategy",
        f"run_dir={tmp_path / 'run'}",
        cwd=work,
    )
    output = f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert sorted(p.name for p in (user / "my_pkg").glob("rank*")) == ["rank0", "rank1"], output
    assert "plait: run directory" in result.stdout, (
        output
    )  # trained to the end (not the exit code: gloo may abort at exit)
