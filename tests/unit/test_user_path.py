"""`trainer.user_path`: the folders a user names, and never the current one, on the import path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from trainer.user_path import (
    USER_PATH_ENV,
    UserPathError,
    drop_current_folder,
    split_user_path,
    use_user_path,
    user_folders,
)


def test_the_flag_is_taken_out_wherever_it_stands() -> None:
    argv = ["--user-path", "a", "pretrain", "optim.lr=1e-3", "--user-path=b", "--cfg", "job", "--user-path", "c=d"]
    assert split_user_path(argv) == (["a", "b", "c=d"], ["pretrain", "optim.lr=1e-3", "--cfg", "job"])
    assert split_user_path(["pretrain", "x=1"]) == ([], ["pretrain", "x=1"])
    with pytest.raises(UserPathError, match="--user-path needs a folder"):
        split_user_path(["pretrain", "--user-path"])


def test_folders_from_the_flag_then_the_environment_each_once(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
    environ = {
        USER_PATH_ENV: os.pathsep.join(["", str(b), str(a), ""])
    }  # empty entries: no folder (not the current one)
    assert user_folders([str(a)], environ) == [str(a.resolve()), str(b.resolve())]
    assert user_folders([], {}) == []
    with pytest.raises(UserPathError, match=rf"^{USER_PATH_ENV}=.*: {tmp_path / 'c'} is not a directory"):
        user_folders([], {USER_PATH_ENV: str(tmp_path / "c")})
    (tmp_path / "f.py").write_text("")
    with pytest.raises(UserPathError, match=r"^--user-path .*f\.py: .* is not a directory"):
        user_folders([str(tmp_path / "f.py")], {})


def test_the_current_folder_leaves_the_path_in_every_spelling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here, other = tmp_path / "here", tmp_path / "other"
    for folder in (here, other):
        folder.mkdir()
    (tmp_path / "link").symlink_to(here)
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", ["", ".", str(here), str(tmp_path / "link"), str(other), str(here) + "/"])
    drop_current_folder()
    assert sys.path == [str(other)]


def test_named_folders_go_last_and_reach_child_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    monkeypatch.chdir(mine)
    monkeypatch.setattr(sys, "path", ["", "/site", str(mine)])
    monkeypatch.delenv(USER_PATH_ENV, raising=False)
    use_user_path([])  # nothing named: the current folder is gone, nothing else added
    assert sys.path == ["/site"] and USER_PATH_ENV not in os.environ
    use_user_path([str(mine)])  # --user-path .: searched on purpose, after everything else
    assert sys.path == ["/site", str(mine)] and os.environ[USER_PATH_ENV] == str(mine)
