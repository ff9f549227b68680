"""Session-wide test settings: one thread per process, a private cache shared by the session's
processes (xdist's workers, the learning tier), the learning tier's plugin."""

from __future__ import annotations

import importlib
import os
import shlex

import pytest

# Before torch is imported anywhere: gloo tests fork several ranks onto 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ("learns.plugin",)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Tests of one file run in this process (pyproject.toml's ``-n 2 --dist loadfile`` would start two
    workers and give the file to one of them), unless ``-n`` is on the command line."""
    files = {arg.split("::")[0] for arg in config.args}
    given = [*config.invocation_params.args, *shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))]
    explicit = any(a.startswith(("-n", "--numprocesses")) for a in given)
    if len(files) == 1 and os.path.isfile(files.pop()) and not explicit:
        config.option.numprocesses = 0


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes the session's temporary folder factory
def pytest_configure(config: pytest.Config) -> None:
    """In the session's first process (xdist's controller, before its workers start): one data cache
    for every process of the session, in pytest's temporary folder of the session (which pytest
    prunes to the last 3 sessions, a killed one's too), unless PLAIT_TEST_CACHE_DIR names one.
    Cache files are written atomically (`trainer.data.cache.write_atomic`): processes may race."""
    if not hasattr(config, "workerinput") and "PLAIT_TEST_CACHE_DIR" not in os.environ:
        # Private, as xdist uses it to give its workers folders inside the controller's.
        os.environ["PLAIT_TEST_CACHE_DIR"] = str(config._tmp_path_factory.mktemp("plait_cache"))
        config.add_cleanup(lambda: os.environ.pop("PLAIT_TEST_CACHE_DIR", None))


@pytest.fixture(scope="session", autouse=True)
def plait_cache_dir() -> str:
    """Tokenizers and packed rows of the whole session (subprocesses inherit PLAIT_CACHE_DIR)."""
    os.environ["PLAIT_CACHE_DIR"] = os.environ["PLAIT_TEST_CACHE_DIR"]
    return os.environ["PLAIT_TEST_CACHE_DIR"]


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
