"""Under CI=true a required test dependency that does not import fails the session (tests/conftest.py)
instead of letting the tests that need it skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REQUIRED_UNDER_CI, missing_required

_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_required_dependencies_import_here() -> None:
    assert missing_required() == []
    assert {"transformers", "wandb"} <= set(REQUIRED_UNDER_CI)


def _session(tmp_path: Path, ci: str) -> subprocess.CompletedProcess[str]:
    """A pytest session of one empty test, with plait's session hook and a wandb that cannot import."""
    (tmp_path / "wandb.py").write_text("raise ImportError('broken install')\n")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('plait_conftest', {str(_CONFTEST)!r})\n"
        "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
        "pytest_sessionstart = module.pytest_sessionstart\n"
    )
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(tmp_path)}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_dependency_fails_a_ci_session(tmp_path: Path) -> None:
    result = _session(tmp_path, "true")
    assert result.returncode != 0
    assert (
        "required test dependencies do not import: wandb (ImportError: broken install)" in result.stdout + result.stderr
    )


def test_outside_ci_the_session_runs(tmp_path: Path) -> None:
    assert _session(tmp_path, "false").returncode == 0
