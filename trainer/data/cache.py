"""Cache keys, seeded digests and atomic cache files, shared by the data modules and the tokenizer.

Every rank of a run prepares the same data; the first to finish fills the cache. Files are
written to a temporary name in the same directory and renamed into place (``os.replace`` is
atomic on one filesystem), so a rank never reads half a file and racing ranks are safe: they
write identical contents.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def digest(*parts: object) -> bytes:
    """sha256 of ``parts`` joined by NUL: the seed of a deterministic draw (a split, a shuffle, a
    synthetic set), the same in every process and on every rank."""
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).digest()


def fingerprint(*parts: str) -> str:
    """16 hex characters of sha256 over ``parts``, each followed by a ``\\x00\\x01`` separator (so
    ``("ab", "c")`` and ``("a", "bc")`` differ): a cache key for what was built from them."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8"))
        digest.update(b"\x00\x01")
    return digest.hexdigest()[:16]


@functools.cache
def code_version() -> str:
    """16 hex characters over the source of the ``trainer.data`` package (every ``.py`` file under
    it, sorted by path), read once per process: a part of the key of every cache file of encoded
    rows, so rows written by other code (an older plait, or one whose encoding or packing was fixed
    since) are built again instead of read back unchanged. The tokenizer's cache has its own
    recipe version (`trainer.data.tokenizer`)."""
    return sources_fingerprint(Path(__file__).parent)


def sources_fingerprint(root: Path) -> str:
    """`fingerprint` of the ``.py`` files under ``root`` (paths and contents), leaving out what is
    no plain file or is hidden: an editor's lock file (``.#text.py``, a dangling link) broke every run."""
    sources = [p for p in sorted(root.rglob("*.py")) if p.is_file() and not p.name.startswith(".")]
    return fingerprint(*(f"{p.relative_to(root)}\0{p.read_bytes().decode('utf-8', 'replace')}" for p in sources))


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Calls ``write(tmp)`` on a temporary file beside ``path``, then renames it to ``path``.

    Raises:
        Whatever ``write`` raises (the temporary file is removed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_dir_problem(cache_dir: str) -> str | None:
    """Why ``data.cache_dir`` cannot hold the cache (it is or lies under a file, or a file cannot be
    written in it), or None; the folder is created, as preparing the data would.

    Args:
        cache_dir: the folder (``${oc.env:PLAIT_CACHE_DIR,'~/.cache/plait'}`` in the data presets).
    """
    path = Path(os.path.expanduser(cache_dir))
    blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    try:
        if blocked is not None:
            raise NotADirectoryError(f"{blocked} is a file, not a folder")
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as err:
        why = err.strerror if err.strerror else str(err)
        return f"data.cache_dir={cache_dir} cannot hold the data cache ({why}); point PLAIT_CACHE_DIR (or data.cache_dir) at a writable folder"
    return None


def report_damaged(path: Path, why: str) -> None:
    """Says on stderr that the cache file ``path`` is damaged (``why``) and is rebuilt."""
    print(f"plait: cache file {path} is damaged ({why}); rebuilding it", file=sys.stderr)


def cached(path: Path, build: Callable[[], T], check: Callable[[T], str | None] | None = None) -> T:
    """The tensors, lists and dicts saved at ``path``, else ``build()``, saved there atomically.

    A file that does not load (truncated, overwritten) or that ``check`` refuses is damaged: said
    so in one line on stderr (`report_damaged`), built again and replaced.

    Args:
        path: the cache file (its name holds the key of what ``build`` depends on).
        build: makes the value on a cache miss; it may hold tensors, numbers, strings, lists and
            dicts (what ``torch.load(weights_only=True)`` reads back).
        check: why a value read back cannot be what ``build`` made (e.g. a token id beyond the
            vocabulary), or None when it can.
    """
    if path.exists():
        try:
            value = torch.load(path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - whatever makes a cache file unreadable, it is rebuilt
            why = str(err).split(". ")[0] or type(err).__name__
        else:
            why = check(value) if check is not None else None
            if why is None:
                return value
        report_damaged(path, why)
    value = build()
    write_atomic(path, lambda tmp: torch.save(value, tmp))
    return value
