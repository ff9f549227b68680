"""A ReST run directory: its files written whole (a kill leaves the old file or the new one) and the
check that a resume fits it (`check_run_dir`), for `trainer.rest.driver.GuidedReST`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.config import ConfigError
from trainer.data.paths import absolute, is_path_key
from trainer.rest.rollouts import prompt_message


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)  # a kill leaves the old file or the new one, never half of one


def write_traces(path: Path, problem_list: Sequence[dict], records: Sequence[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in records:
            p = problem_list[r["problem"]]
            row = {
                "prompt": prompt_message(p),
                "completion": r["text"],
                **r,
                "numbers": p["numbers"],
                "target": p["target"],
            }
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def changed(saved: DictConfig, cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, value now)`` of every leaf that differs, but those that do not change
    what the rounds compute (``run_dir``, ``resume``, the progress bar, the cache folder); a local
    path compares as the file it names (a run started before paths were made absolute recorded
    them as typed: `trainer.data.paths.absolute`)."""
    ignore = ("run_dir", "resume", "trainer.enable_progress_bar", "data.cache_dir")

    def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict):
            return {k: v for key, sub in node.items() for k, v in leaves(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    before = leaves(OmegaConf.to_container(saved, resolve=True))
    now = leaves(OmegaConf.to_container(cfg, resolve=True))
    keys = sorted(set(before) | set(now))
    return [
        (k, before.get(k), now.get(k))
        for k in keys
        if k not in ignore
        and before.get(k) != now.get(k)
        and not (is_path_key(k) and absolute(before.get(k)) == absolute(now.get(k)))
    ]


def check_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Refuses a run directory that does not fit ``resume``: rounds without resume=last, resume=last
    without rounds, another resume, or a config that differs from the one the run started with
    (`changed`).

    Raises:
        ConfigError: each problem, naming the fix.
    """
    started = (run_dir / "round_0").exists()
    if cfg.resume is None and started:
        raise ConfigError(
            [f"run_dir={run_dir} already holds ReST rounds; continue it with resume=last, or choose a new run_dir"]
        )
    if cfg.resume is not None and cfg.resume != "last":
        raise ConfigError(
            [f"resume={cfg.resume}: a ReST run resumes its own run directory; use resume=last run_dir=<the run>"]
        )
    if cfg.resume == "last" and not started:
        raise ConfigError([f"run_dir={run_dir} holds no ReST round to resume; drop resume to start fresh"])
    if cfg.resume == "last" and (run_dir / "config.yaml").is_file():
        differing = changed(OmegaConf.load(run_dir / "config.yaml"), cfg)
        if differing:
            raise ConfigError(
                [
                    f"{key}: {old} when {run_dir} started, {new} now; a resumed ReST run continues with its own "
                    f"config (resume=last {key}={old}), or start a new run_dir"
                    for key, old, new in differing
                ]
                + [f"plait resume {run_dir} continues it with the config it started with, nothing typed again"]
            )
