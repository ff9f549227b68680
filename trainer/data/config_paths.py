"""The config's local paths made absolute where the command is typed (`absolute_paths`): the data,
the tokenizer, the model to start from and each named source's local file, so that the run records
them so (config.yaml, every checkpoint) and ``plait resume`` from another folder finds the files.
A module of its own: it reads the sources' catalogs, which read `trainer.data.paths`.
"""

from __future__ import annotations

from typing import Any

from hydra.utils import get_class
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.data.paths import PATH_KEYS, absolute
from trainer.data.prompts import PROMPTS
from trainer.data.sources import CONVERSATIONS, PAIRS


def path_keys(cfg: Any) -> list[str]:
    """The dotted keys of ``cfg`` (an OmegaConf config) that `absolute_paths` makes absolute:
    ``PATH_KEYS`` and every ``data.sources.<name>.source`` that is no name of the data module's
    catalog (its ``catalog``: a bundled or synthetic source is read by name even where a file of
    that name exists here; a data module without one: no name of any catalog)."""
    sources = OmegaConf.select(cfg, "data.sources", default=None, throw_on_missing=False)
    if not OmegaConf.is_dict(sources):
        return list(PATH_KEYS)
    try:
        catalogs = [get_class(str(OmegaConf.select(cfg, "data._target_"))).catalog]
    except Exception:  # noqa: BLE001 - no target, one that does not import (validate says), or no catalog
        catalogs = [CONVERSATIONS, PAIRS, PROMPTS]
    names = {n for catalog in catalogs for n in catalog.names()}
    keys = []
    for name in sources:
        try:
            source = OmegaConf.select(sources, f"{name}.source", default=None, throw_on_missing=False)
        except OmegaConfBaseException:  # an interpolation that does not resolve: validate names it
            continue
        if isinstance(source, str) and source not in names:
            keys.append(f"data.sources.{name}.source")
    return [*PATH_KEYS, *keys]


def absolute_paths(cfg: Any) -> Any:
    """``cfg`` (an OmegaConf config, changed in place and returned) with its local paths
    (`path_keys`: the data, the tokenizer, the model to start from, a source's local file) made
    `absolute`: the run records them so (config.yaml, every checkpoint), ``plait resume`` from
    another folder finds the files, and a resume compares the paths, not how they were typed."""
    for key in path_keys(cfg):
        try:
            value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        except OmegaConfBaseException:  # an interpolation that does not resolve: validate names it
            continue
        if value is None:
            continue
        plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if (new := absolute(plain)) != plain:
            OmegaConf.update(cfg, key, new, merge=False)
    return cfg
