"""The manifest of a checkpoint directory: every file's size and SHA-256, written last.

``manifest.json`` is the last file a save writes (inside the temporary directory, before the
atomic rename), so a checkpoint is complete exactly when its manifest exists, and intact exactly
when every file matches it and no other file is present. A kill at any point of a save leaves
either no manifest or a directory that still has its ``.tmp`` name; a damaged shard, a truncated
``meta.pt`` or a planted extra file fails `verify`.

The hashing is split over the ranks that wrote the checkpoint (`hash_files` on each rank's share
of the files), and `verify` hashes files in parallel threads (hashlib releases the GIL).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1


def sha256(path: Path) -> str:
    """Hex SHA-256 of the file ``path``."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def checkpoint_files(root: Path) -> list[str]:
    """Every file under ``root`` but the manifest, as sorted POSIX paths relative to ``root``."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def hash_files(root: Path, names: Iterable[str]) -> dict[str, dict[str, int | str]]:
    """``{name: {"size": bytes, "sha256": hex}}`` of the files ``names`` under ``root``."""
    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(names)))) as pool:
        digests = list(pool.map(lambda name: sha256(root / name), names))
    return {name: {"size": (root / name).stat().st_size, "sha256": digest} for name, digest in zip(names, digests)}


def write_manifest(root: Path, files: dict[str, dict[str, int | str]]) -> None:
    """Writes ``root/manifest.json`` listing ``files`` (from `hash_files`), durably (fsync)."""
    tmp = root / f".{MANIFEST}.tmp"
    with open(tmp, "w") as file:
        json.dump({"format": FORMAT, "files": dict(sorted(files.items()))}, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, root / MANIFEST)


def digest(root: Path) -> str | None:
    """SHA-256 of ``root``'s manifest: one hex string that names the checkpoint's content (its files'
    sizes and digests), wherever it lies; None without a manifest (a Hugging Face directory, an
    unfinished save, a checkpoint of an older plait)."""
    manifest = root / MANIFEST
    return sha256(manifest) if manifest.is_file() else None


def verify(root: Path, *, checksums: bool = True) -> str | None:
    """Why the checkpoint directory ``root`` is not intact, or None when it is.

    Args:
        checksums: also compare SHA-256 digests (False: names and sizes only, for a quick check).
    """
    manifest = root / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (a save that did not finish, or a checkpoint of an older plait)"
    try:
        listed = json.loads(manifest.read_text())["files"]
        expected = {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {err})"
    present = checkpoint_files(root)
    if missing := sorted(set(expected) - set(present)):
        return f"{', '.join(missing)} missing"
    if extra := sorted(set(present) - set(expected)):
        return f"{', '.join(extra)} not in {MANIFEST}"
    for name in present:
        if (size := (root / name).stat().st_size) != expected[name][0]:
            return f"{name} has {size} bytes, {MANIFEST} says {expected[name][0]}"
    if checksums:
        actual = hash_files(root, present)
        for name in present:
            if actual[name]["sha256"] != expected[name][1]:
                return f"{name} does not match its SHA-256 in {MANIFEST} (damaged)"
    return None
