"""Session-wide test settings: one thread per process, a private cache, short process-group timeouts."""

from __future__ import annotations

import importlib
import os

import pytest

# Before torch is imported anywhere: gloo tests fork several ranks onto 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def plait_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tokenizers and packed rows of the whole session (subprocesses inherit PLAIT_CACHE_DIR)."""
    cache = os.environ.get("PLAIT_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("plait_cache"))
    os.environ["PLAIT_CACHE_DIR"] = cache
    return cache


# What CI installs and some tests would otherwise skip without (the Hugging Face reference,
# the wandb logger), and trl (tests/unit/test_grpo_loss_trl.py's reference, imported there at module
# level): under CI=true a missing or broken one fails the run instead.
REQUIRED_UNDER_CI = ("transformers", "wandb", "trl")


def missing_required(modules: tuple[str, ...] = REQUIRED_UNDER_CI) -> list[str]:
    """The ``modules`` that cannot be imported, each with its error."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a broken install raises more than ImportError
            missing.append(f"{name} ({type(err).__name__}: {err})")
    return missing


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``CI=true`` (set by .ci/run) every test dependency must import: no silent skips."""
    if os.environ.get("CI", "").lower() == "true" and (missing := missing_required()):
        raise pytest.UsageError(
            "CI=true but required test dependencies do not import: " + "; ".join(missing) + " (pip install -e '.[dev]')"
        )
