"""A data cache folder (PLAIT_CACHE_DIR, data.cache_dir) that is a file, lies under one or cannot
be written is refused by validate, before launch (it was a FileExistsError inside the run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from harness import compose_config

from trainer.config import ConfigError, validate

FIX = "point PLAIT_CACHE_DIR (or data.cache_dir) at a writable folder"


def _problems(cache_dir: Path | str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose_config([f"data.cache_dir={cache_dir}"]))
    return err.value.problems


def test_a_cache_dir_that_is_or_lies_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("not a folder\n")
    for cache_dir in (tmp_path / "cache", tmp_path / "cache" / "plait"):
        assert _problems(cache_dir) == [
            f"data.cache_dir={cache_dir} cannot hold the data cache ({tmp_path / 'cache'} is a file, not a folder); {FIX}"
        ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_cache_dir_that_cannot_be_made_is_refused() -> None:
    """/proc takes no new folder, not even from root (a chmod'ed folder would not stop root)."""
    (problem,) = _problems("/proc/plait_cache")
    assert problem.startswith("data.cache_dir=/proc/plait_cache cannot hold the data cache (") and problem.endswith(FIX)


def test_a_writable_cache_dir_is_made(tmp_path: Path) -> None:
    validate(compose_config([f"data.cache_dir={tmp_path / 'new' / 'cache'}"]))
    assert (tmp_path / "new" / "cache").is_dir()
