"""Session-wide test settings: one thread per process, a private cache, short process-group timeouts."""

from __future__ import annotations

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
