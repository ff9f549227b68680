"""Encoders: records -> token samples ``(input_ids, labels)``, labels pre-shifted (-100: no target).

One encoder per record kind; each is where a new format of that kind plugs in:

- text (`documents`): a document followed by EOS; every next token is a target, the EOS position
  predicts nothing, so no target crosses a document boundary (C19);
- chat (`conversations`): the chat template's segments (trainer.data.chat), loss only on the
  assistant tokens (or on a template's ``{% generation %}`` blocks); the default template ends
  every assistant turn with EOS. A standard row (`trainer.data.chat.Text`, TRL's standard
  format) is its prompt then its completion, no template, loss on the completion, which ends with
  EOS (added unless its text ends with the EOS token: TRL's ``add_eos``);
- pair (`pair`, `pair_rows`): a preference pair, chosen and rejected with the **same prompt ids**
  and labels only on the final response (case C24).

Samples then go to the packer (trainer.data.packing); pairs are laid out one response per row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from trainer.data.base import DataError
from trainer.data.chat import JinjaTemplate, Record, default_segments, text_segments
from trainer.data.packing import IGNORE_INDEX, rows_to_tensors
from trainer.data.tokenizer import Tokenizer

Sample = tuple[Sequence[int], Sequence[int]]  # (input_ids, labels), equal lengths
# source_ids: 0 on the row's tokens, -1 on its pad tail (the packer's mark, which a routed model reads).
PAIR_KEYS = ("input_ids", "labels", "position_ids", "document_ids", "source_ids")


def documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[Sample]:
    """Pretraining samples of ``texts`` (see `document_samples`), with one batched tokenizer call."""
    return document_samples(tokenizer.encode_batch(list(texts)) if texts else [], eos_id=tokenizer.eos_id)


def document_samples(token_docs: Sequence[Sequence[int]], *, eos_id: int) -> list[Sample]:
    """Document ``d`` becomes ``d + [eos]`` with labels ``d[1:] + [eos, -100]``: the last text
    token predicts EOS and the EOS position predicts nothing. Empty documents are left out.
    Built as one stream (views of it per document): no per-token Python."""
    lengths = np.fromiter((len(d) for d in token_docs), dtype=np.int64, count=len(token_docs))
    tokens = np.fromiter(itertools.chain.from_iterable(token_docs), dtype=np.int64, count=int(lengths.sum()))
    ends = np.cumsum(lengths[lengths > 0] + 1)  # one past each EOS
    is_eos = np.zeros(int(ends[-1]) if len(ends) else 0, dtype=bool)
    is_eos[ends - 1] = True
    ids = np.empty(is_eos.shape[0], dtype=np.int64)
    ids[is_eos], ids[~is_eos] = eos_id, tokens
    labels = np.empty_like(ids)
    labels[:-1] = ids[1:]
    labels[is_eos] = IGNORE_INDEX
    return list(zip(np.split(ids, ends[:-1]), np.split(labels, ends[:-1]))) if len(ends) else []


def labels_from_mask(input_ids: Sequence[int], supervised: Sequence[bool]) -> list[int]:
    """Pre-shifted labels: ``labels[t] = input_ids[t+1]`` when token t+1 is supervised, else -100.

    The first token is never a target (nothing precedes it within the sample).
    """
    n = len(input_ids)
    return [input_ids[t + 1] if supervised[t + 1] else IGNORE_INDEX for t in range(n - 1)] + (
        [IGNORE_INDEX] if n else []
    )


def segments(record: Record, template: JinjaTemplate | None) -> list[tuple[str, bool]]:
    """The ``(text, supervised)`` segments of one record: a standard row's own (no template), a
    conversation's by ``template`` (None: the default template)."""
    if isinstance(record, dict):
        return text_segments(record)
    return default_segments(record) if template is None else template.segments(record)


def _ends_with_eos(record: Record, template: JinjaTemplate | None, tokenizer: Tokenizer) -> bool:
    """Whether an EOS id follows each supervised segment: always after the default template's
    answers, never in a tokenizer's template (it writes its own end of turn), after a standard
    row's completion unless its text already ends with the EOS token (TRL's ``add_eos``)."""
    if isinstance(record, dict):
        return not record["completion"].endswith(tokenizer.eos_token)
    return template is None


def _segment_ids(
    tokenizer: Tokenizer, records: Sequence[Record], template: JinjaTemplate | None
) -> list[list[tuple[list[int], bool]]]:
    """Per record, ``(ids, supervised)`` of each segment (`segments`), with one batched tokenizer
    call; an EOS follows each supervised segment where `_ends_with_eos` says."""
    per_record = [segments(r, template) for r in records]
    flat = [text for parts in per_record for text, _ in parts]
    encoded = iter(tokenizer.encode_batch(flat) if flat else [])
    out = []
    for record, parts in zip(records, per_record):
        eos = [tokenizer.eos_id] if _ends_with_eos(record, template, tokenizer) else []
        out.append([(next(encoded) + (eos if sup else []), sup) for _, sup in parts])
    return out


def conversations(
    tokenizer: Tokenizer, convs: Sequence[Record], template: JinjaTemplate | None = None
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of each record, labels -100 off the supervised tokens (assistant
    tokens of a conversation, a standard row's completion).

    Args:
        tokenizer: encodes each segment (no special tokens added).
        convs: conversations (each with at least one assistant message) or standard rows.
        template: the tokenizer's chat template, or None for the default template (standard rows
            never use it).

    Raises:
        ChatError: a malformed conversation or a template without prefix-consistent rendering.
    """
    out = []
    for segments in _segment_ids(tokenizer, convs, template):
        ids = [t for piece, _ in segments for t in piece]
        supervised = [sup for piece, sup in segments for _ in piece]
        out.append((ids, labels_from_mask(ids, supervised)))
    return out


def pair(
    tokenizer: Tokenizer, record: dict[str, Any], template: JinjaTemplate | None = None
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of one pair in the chat format: the prompt is the
    conversation up to the final supervised span (earlier assistant turns are context, never
    targets), each response is that span: the final turn's, or with a template's
    ``{% generation %}`` blocks, the final block's text.

    Raises:
        trainer.data.chat.ChatError: a malformed conversation.
        DataError: the template renders the prompt differently for the two responses, or the
            final supervised span is not the final turn (the text after it differs).
    """
    convs = [[*record["messages"], {"role": "assistant", "content": r}] for r in (record["chosen"], record["rejected"])]
    encoded = []
    for segments in _segment_ids(tokenizer, convs, template):
        last = max(i for i, (_, supervised) in enumerate(segments) if supervised)
        before, after = ([t for piece, _ in part for t in piece] for part in (segments[:last], segments[last + 1 :]))
        encoded.append((before, segments[last][0], after))
    if encoded[0][0] != encoded[1][0]:
        raise DataError("the chat template renders the prompt differently for the chosen and rejected responses")
    if encoded[0][2] != encoded[1][2]:
        raise DataError(
            "the chat template's last supervised span is not the final assistant turn (the text after it differs between "
            "the chosen and rejected responses); use data.template=default"
        )
    return encoded[0][0], encoded[0][1], encoded[1][1]


class PairCut(NamedTuple):
    """Tokens `pair_rows` cut from one pair: of the prompt (at its start), of each response (at its end)."""

    prompt: int
    chosen: int
    rejected: int


def pair_rows(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    *,
    seq_len: int,
    max_prompt_len: int,
    pad_id: int,
    fit_first: bool = False,
) -> tuple[dict[str, Tensor], PairCut]:
    """The ``[2, seq_len]`` rows of one pair (chosen first) and what was cut (`PairCut`).

    When prompt + the longer response is too long, the prompt keeps at most its last
    ``max_prompt_len`` tokens (TRL's ``max_prompt_length``), then both responses are cut at the
    end to what is left. A pair that fits is kept whole. ``labels[t] = input_ids[t + 1]`` where token
    t+1 is a response token, else -100; the pad tail is a document of its own.

    Args:
        fit_first: the prompt is cut only when prompt + the first response does not fit (KTO's
            unpaired rows: the second is another prompt's completion, for the KL estimate alone,
            cut at its end to what the row leaves).
    """
    longest = len(chosen) if fit_first else max(len(chosen), len(rejected))
    keep = len(prompt) if len(prompt) + longest <= seq_len else min(len(prompt), max_prompt_len)
    cut = PairCut(len(prompt) - keep, max(0, len(chosen) - (seq_len - keep)), max(0, len(rejected) - (seq_len - keep)))
    prompt = prompt[len(prompt) - keep :]
    room = seq_len - len(prompt)
    rows = []
    for response in (chosen[:room], rejected[:room]):
        labels = [IGNORE_INDEX] * (len(prompt) - 1) + response + [IGNORE_INDEX]
        rows.append(
            [(0, np.asarray(prompt + response, np.int64), np.asarray(labels[: len(prompt) + len(response)], np.int64))]
        )
    tensors = rows_to_tensors(rows, num_rows=2, seq_len=seq_len, pad_id=pad_id)
    return {k: tensors[k] for k in PAIR_KEYS}, cut


def stack_rows(rows: list[dict[str, Tensor]], seq_len: int) -> dict[str, Tensor]:
    """``[N, 2, seq_len]`` tensors of N pairs' rows (an empty split gives N = 0)."""
    return {
        k: torch.stack([r[k] for r in rows]) if rows else torch.zeros(0, 2, seq_len, dtype=torch.long)
        for k in PAIR_KEYS
    }
