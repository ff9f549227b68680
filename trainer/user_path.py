"""Where plait imports a user's own code from: the folders the user names, never the current one.

A ``_target_`` may name a class of the user's (``strategy._target_=my_pkg.MyStrategy``, a model,
a callback). Python finds it on ``sys.path``, and plait adds to that only the folders named with
``plait --user-path DIR`` (repeatable, anywhere on the command line) or ``PLAIT_USER_PATH=DIR[:DIR]``,
after plait's own packages and the installed ones, so a ``trainer.py`` there does not shadow plait.

The folder a command starts in is never searched: it may be a downloaded run directory, and a
``pynvml.py``, ``opt_einsum.py`` or ``hydra_plugins/`` there would run as soon as a library tries
the optional module it names. Python itself puts that folder on the path for ``python -m
trainer.cli`` (first: torchrun's workers start that way) and for an empty ``PYTHONPATH`` entry
(``PYTHONPATH=:x``); `drop_current_folder` takes it off before plait imports anything else. What
Python imported before that (the ``trainer`` package itself) it looked for there first, so in a
folder you did not fill, run the ``plait`` script or ``python -P -m trainer.cli``.

Child processes (the ranks plait starts, torchrun's, data workers) see the same folders: they
inherit ``PLAIT_USER_PATH``, which `use_user_path` sets to the whole list.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

USER_PATH_ENV = "PLAIT_USER_PATH"
FLAG = "--user-path"


class UserPathError(ValueError):
    """A ``--user-path`` without a folder, or a named folder that is not a directory."""


def _current_folder() -> str | None:
    try:
        return os.path.realpath(os.getcwd())
    except OSError:  # the folder was deleted under the process: nothing on the path can name it
        return None


def drop_current_folder() -> None:
    """Removes every ``sys.path`` entry that is the current folder (``''``, ``.``, its absolute path)."""
    cwd = _current_folder()
    if cwd is not None:
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != cwd]


def split_user_path(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the folders named with ``--user-path DIR`` or ``--user-path=DIR``, the other arguments).

    Raises:
        UserPathError: a ``--user-path`` that ends the command line.
    """
    folders, rest = [], []
    args = iter(argv)
    for arg in args:
        if arg == FLAG:
            folder = next(args, None)
            if folder is None:
                raise UserPathError(f"{FLAG} needs a folder: plait {FLAG} DIR COMMAND ...")
            folders.append(folder)
        elif arg.startswith(FLAG + "="):
            folders.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return folders, rest


def user_folders(flagged: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The absolute folders to import user code from: ``flagged`` (``--user-path``) first, then
    those of ``PLAIT_USER_PATH`` (``os.pathsep``-separated; empty entries ignored), each once.

    Raises:
        UserPathError: a folder that is not a directory, naming where it was given.
    """
    environ = os.environ if environ is None else environ
    named = [(folder, f"{FLAG} {folder}") for folder in flagged]
    listed = environ.get(USER_PATH_ENV, "")
    named += [(folder, f"{USER_PATH_ENV}={listed}") for folder in listed.split(os.pathsep)]
    found: list[str] = []
    for folder, where in named:
        if not folder:  # an empty entry means no folder here (for PYTHONPATH it means the current one)
            continue
        if not os.path.isdir(folder):
            raise UserPathError(f"{where}: {folder} is not a directory; name the folder that holds your package")
        if (absolute := os.path.realpath(folder)) not in found:
            found.append(absolute)
    return found


def use_user_path(folders: Sequence[str]) -> None:
    """Takes the current folder off ``sys.path`` and appends ``folders`` (absolute, from
    `user_folders`) after everything else; exports them in ``PLAIT_USER_PATH`` for child processes."""
    import strategies  # noqa: F401 - bound before any user folder joins the path (an editable
    # install's finder comes after the path's: a strategies.py there would otherwise win the import)

    drop_current_folder()
    sys.path.extend(f for f in folders if f not in sys.path)
    if folders:
        os.environ[USER_PATH_ENV] = os.pathsep.join(folders)
