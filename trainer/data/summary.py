"""The data lines a run prints before training (``plait: data: ...``, then what was cut).

Reads a data module's prepared data (`trainer.data.base.DataModule.prepare`): its ``train`` and
``val`` splits are packed rows (``PackedRows``: pretraining), tokenized samples per source
(``dict[str, SourceSamples]``: SFT) or ``[N, 2, T]`` pair tensors (``dict[str, Tensor]``:
preference; KTO's labelled rows, with their KL rows, counted once; tokens without the pad tails) or prompts (a list of
``PromptItem``: online RL). Only counts, no second pass over the data.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainer.data.accounting import report_lines
from trainer.data.mixture import SourceSamples
from trainer.data.packing import PackedRows


def _split(split: Any) -> tuple[int, int, str]:
    """(rows/samples/pairs, tokens, their noun) of one split."""
    if isinstance(split, PackedRows):
        return len(split), split.input_ids.numel(), "rows"
    if isinstance(split, dict) and split and all(isinstance(v, SourceSamples) for v in split.values()):
        return sum(len(v) for v in split.values()), sum(v.ids.size for v in split.values()), "samples"
    if isinstance(split, dict) and isinstance(split.get("input_ids"), Tensor):
        ids = split["input_ids"]
        # A pair's row is one document, then its pad tail (another): the tokens are the first document's.
        docs = split.get("document_ids")
        real = (
            (docs == 0)
            if isinstance(docs, Tensor) and docs.shape == ids.shape
            else torch.ones_like(ids, dtype=torch.bool)
        )
        if "desirable" in split:  # KTO's unpaired rows: [N, 2, T], the completion and its KL row
            return ids.shape[0], int(real[:, 0].sum()), "labelled rows"
        return ids.shape[0], int(real.sum()), "pairs" if ids.dim() == 3 else "rows"
    if isinstance(split, list) and split and isinstance(getattr(split[0], "ids", None), list):  # prompts
        return len(split), sum(len(item.ids) for item in split), "prompts"
    return 0, 0, "rows"


def data_summary(prepared: Any, evaluated: int | None = None) -> str:
    """``data: 812 training rows (207,872 tokens), 92 held-out rows (23,552 tokens; 64 evaluated); vocabulary 4,096``.

    Args:
        prepared: a data module's prepared data (``train``, ``val``, ``tokenizer``; optional
            ``documents``: (training, held-out) documents of a text corpus).
        evaluated: how many held-out rows each evaluation scores (``data.eval_rows``), when fewer.
    """
    (n_train, t_train, noun), (n_val, t_val, _) = _split(prepared.train), _split(prepared.val)
    scored = f"; {evaluated:,} evaluated" if evaluated is not None and evaluated < n_val else ""
    if prepared.train is None:  # a stream (trainer.data.stream): its length is not known ahead
        parts = [f"training rows streamed, {n_val:,} held-out {noun} ({t_val:,} tokens{scored})"]
    else:
        parts = [
            f"{n_train:,} training {noun} ({t_train:,} tokens), {n_val:,} held-out {noun} ({t_val:,} tokens{scored})"
        ]
    documents = getattr(prepared, "documents", None)
    if documents is not None:
        parts.append(f"{documents[0]:,} training and {documents[1]:,} held-out documents")
    if isinstance(prepared.train, dict) and noun == "samples":
        parts.append(f"{len(prepared.train)} sources")
    parts.append(f"vocabulary {prepared.tokenizer.vocab_size:,}")
    return "data: " + "; ".join(parts)


def epochs_line(prepared: Any, rows_per_step: int, planned_steps: int) -> str | None:
    """How many times the run passes over its training rows, pairs or labelled rows, when more
    than once (a small set repeats in silence otherwise); None for one pass or less, a stream, SFT
    samples (their budgets say it: ``max_epochs``) and prompts (online RL samples its own rows)."""
    if prepared.train is None:
        return None
    n_train, _, noun = _split(prepared.train)
    if noun not in ("rows", "pairs", "labelled rows") or not n_train:
        return None
    drawn = rows_per_step * planned_steps
    if drawn < 2 * n_train:
        return None
    return (
        f"the run's {planned_steps:,} steps draw {rows_per_step:,} {noun} each: {drawn / n_train:.1f} epochs of the "
        f"{n_train:,} training {noun}"
    )


def describe(data: Any) -> list[str]:
    """The launch lines of a data module (`trainer.data.base.DataModule`): `data_summary` (packed
    rows say how many of the held-out rows an evaluation scores, ``data.eval_rows``), then what
    preparation cut from each source and the warnings (`trainer.data.accounting.report_lines`)."""
    prepared = data.prepare()
    evaluated = len(data.eval_rows()["input_ids"]) if isinstance(prepared.val, PackedRows) else None
    return [data_summary(prepared, evaluated), *report_lines(data.data_counts(), data.noun, data.held_out_counts())]
