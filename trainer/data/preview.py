"""What the model sees: training rows -> decoded text with the supervised tokens marked, per source.

Reads the rows a prepared data module trains on, never a second encoding of the records: the
packed batches of `trainer.data.base.DataModule.train_batches` in the order a run draws them
(SFT, pretraining text: `token_samples`), or the ``[N, 2, T]`` rows of preference pairs
(`pair_samples`). A packed row is cut back into its samples by ``document_ids`` and named by
its ``source_ids``; the pad tail is left out.

Marks follow the label convention of `trainer.data.packing`: labels are pre-shifted, so token
``t + 1`` is supervised (a loss target) exactly when ``labels[t] != -100`` (`marks`). A label that
is not the next input token (an encoder's bug) is counted, never hidden (`Sample.mismatched`).
The text is decoded span by span (`render`) and the supervised spans are wrapped in ``«»`` (or
coloured on a terminal: `Style`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from trainer.data.base import DataModule
from trainer.data.loader import GlobalBatches
from trainer.data.packing import IGNORE_INDEX
from trainer.data.preference import PreferenceDataModule
from trainer.data.prompts import PromptDataModule
from trainer.data.sft import SFTDataModule
from trainer.data.summary import describe
from trainer.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class Style:
    """How a supervised span is shown: ``«text»`` in plain text, green on a terminal."""

    open: str
    close: str
    legend: str


PLAIN = Style("«", "»", "«...» = supervised tokens (labels != -100: the loss is taken on them); the rest is context")
COLOR = Style(
    "\x1b[1;32m", "\x1b[0m", "\x1b[1;32mgreen\x1b[0m = supervised tokens (labels != -100); the rest is context"
)


@dataclass
class Sample:
    """One sample (or piece of a long one) as trained: its ids and pre-shifted labels.

    Args:
        where: where it is trained (``step 1, row 0, tokens 0-22``; ``pair 3``).
        title: which row of a pair (``chosen``, ``rejected``), empty otherwise.
    """

    source: str
    ids: list[int]
    labels: list[int]
    where: str
    title: str = ""
    row_end: bool = False  # it ends where its row ends (a longer sample would continue in the next row)

    @property
    def supervised(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)

    @property
    def mismatched(self) -> int:
        """Labels that are neither -100 nor the next input token (within the sample)."""
        return sum(
            1 for t in range(len(self.ids) - 1) if self.labels[t] != IGNORE_INDEX and self.labels[t] != self.ids[t + 1]
        )

    @property
    def continues(self) -> bool:
        """Whether its last label targets a token past its end (a long sample split over rows)."""
        return bool(self.labels) and self.labels[-1] != IGNORE_INDEX


@dataclass
class Totals:
    """What one pass trains of a source: samples (pieces), tokens, supervised tokens."""

    samples: int = 0
    tokens: int = 0
    supervised: int = 0


def marks(labels: Sequence[int]) -> list[bool]:
    """Per token, whether it is a loss target: token ``t + 1`` is when ``labels[t] != -100``; the
    first token never is (nothing before it in the sample predicts it)."""
    return [False] + [label != IGNORE_INDEX for label in labels[:-1]]


def render(tokenizer: Tokenizer, ids: Sequence[int], supervised: Sequence[bool], style: Style = PLAIN) -> str:
    """The decoded text of ``ids``, each run of supervised tokens wrapped in ``style``'s marks.

    Each span is the difference of decoding the ids up to its end and up to its start, so a
    tokenizer that decodes a word's leading space from context keeps it; a span that splits a
    character's bytes falls back to decoding the span alone.
    """
    out, done, start = [], "", 0
    for end in [i for i in range(1, len(ids)) if supervised[i] != supervised[i - 1]] + [len(ids)]:
        upto = tokenizer.decode(ids[:end])
        text = upto[len(done) :] if upto.startswith(done) else tokenizer.decode(ids[start:end])
        out.append(f"{style.open}{text}{style.close}" if supervised[start] else text)
        done, start = upto, end
    return "".join(out)


def _documents(row_docs: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of equal document ids in one row."""
    cuts = [0, *(np.flatnonzero(np.diff(row_docs)) + 1).tolist(), len(row_docs)]
    return list(itertools.pairwise(cuts))


def _is_pad(ids: np.ndarray, labels: np.ndarray, pad_id: int) -> bool:
    return bool((ids == pad_id).all() and (labels == IGNORE_INDEX).all())


def token_samples(
    batches: GlobalBatches, names: Sequence[str], pad_id: int, *, per_source: int, count: bool = True
) -> tuple[dict[str, list[Sample]], dict[str, Totals], int]:
    """The first ``per_source`` samples of each source in training order, what one pass trains of
    each source, and the global batches read.

    Args:
        batches: one dp rank of one (the whole global batch), from its start.
        names: source names by ``source_ids`` (rows without ``source_ids`` belong to ``names[0]``).
        pad_id: the tokenizer's pad id (a pad tail without ``source_ids`` is recognised by it).
        count: read the whole pass for the totals; False stops once every source has its samples.
    """
    samples: dict[str, list[Sample]] = {n: [] for n in names}
    totals = {n: Totals() for n in names}
    steps = 0
    for step, (batch, _, _) in enumerate(batches.batches(batches.start()), start=1):
        steps = step
        ids_b, labels_b, docs_b = (batch[k].numpy() for k in ("input_ids", "labels", "document_ids"))
        sources_b = batch["source_ids"].numpy() if "source_ids" in batch else np.zeros_like(ids_b)
        for row in range(ids_b.shape[0]):
            for start, end in _documents(docs_b[row]):
                ids, labels, source = ids_b[row, start:end], labels_b[row, start:end], int(sources_b[row, start])
                if source < 0 or ("source_ids" not in batch and _is_pad(ids, labels, pad_id)):
                    continue
                name = names[source]
                total = totals[name]
                total.samples, total.tokens = total.samples + 1, total.tokens + len(ids)
                total.supervised += int((labels != IGNORE_INDEX).sum())
                if len(samples[name]) < per_source:
                    where = f"step {step}, row {row}, tokens {start}-{end - 1}"
                    row_end = end == ids_b.shape[1]
                    samples[name].append(Sample(name, ids.tolist(), labels.tolist(), where, row_end=row_end))
        if not count and all(len(s) >= per_source for s in samples.values()):
            break
    return samples, totals, steps


def pair_samples(
    rows: dict[str, Tensor], sources: Sequence[str], *, per_source: int, titles: tuple[str, str]
) -> tuple[dict[str, list[Sample]], dict[str, Totals]]:
    """The first ``per_source`` pairs of each source (both rows, titled ``titles``) and each
    source's totals over all its pairs.

    Args:
        rows: ``[N, 2, T]`` ``input_ids``, ``labels`` and ``document_ids`` (the pair's tokens are
            document 0, the pad tail document 1: `trainer.data.encode.pair_rows`); with
            ``desirable`` ``[N]`` (KTO's rows), the first row's title says which.
        sources: the source of each of the N pairs.
    """
    desirable = rows["desirable"].tolist() if "desirable" in rows else None
    samples: dict[str, list[Sample]] = {n: [] for n in dict.fromkeys(sources)}
    totals = {n: Totals() for n in samples}
    ids_b, labels_b, docs_b = (rows[k].numpy() for k in ("input_ids", "labels", "document_ids"))
    for i, name in enumerate(sources):
        totals[name].samples += 1
        for j, title in enumerate(titles):
            n = int((docs_b[i, j] == 0).sum())
            totals[name].tokens += n
            totals[name].supervised += int((labels_b[i, j, :n] != IGNORE_INDEX).sum())
            if len(samples[name]) < 2 * per_source:
                if desirable is not None and j == 0:
                    title = f"{title} ({'desirable' if desirable[i] else 'undesirable'})"
                sample = Sample(name, ids_b[i, j, :n].tolist(), labels_b[i, j, :n].tolist(), f"pair {i}", title)
                samples[name].append(sample)
    return samples, totals


@dataclass
class Shown:
    """The lines of one sample: a header, then its marked text."""

    header: str
    text: str
    notes: list[str] = field(default_factory=list)


def show(sample: Sample, tokenizer: Tokenizer, number: int, style: Style = PLAIN) -> Shown:
    """`render` of one sample with its header (where, tokens, supervised) and its warnings."""
    title = f" {sample.title}" if sample.title else ""
    header = (
        f"-- {sample.source}: sample {number}{title} ({sample.where}; {len(sample.ids)} tokens, "
        f"{sample.supervised} supervised)"
    )
    notes = []
    if sample.mismatched:
        notes.append(f"warning: {sample.mismatched} labels are not the next token (the marks may be wrong)")
    if sample.continues:
        notes.append("(continues in the next row: its last label is that row's first token)")
    elif sample.row_end:
        notes.append(
            "(reaches the end of its row: a longer sample is cut here, or continued in the next row by data.long_samples=split)"
        )
    return Shown(header, render(tokenizer, sample.ids, marks(sample.labels), style), notes)


def table(rows: Iterable[Sequence[str]]) -> list[str]:
    """Right-aligned columns (the first left-aligned), two spaces apart."""
    rows = [list(r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def _sources(data: DataModule, per_source: int, count: bool) -> tuple[dict[str, list[Sample]], dict[str, Totals], str]:
    """The samples and totals of ``data``'s training rows, and the order they are shown in."""
    if isinstance(data, PreferenceDataModule):
        titles = ("completion", "KL row (another prompt's completion)") if data.unpaired else ("chosen", "rejected")
        samples, totals = pair_samples(
            data.pairs("train"), data.row_sources("train"), per_source=per_source, titles=titles
        )
        return samples, totals, f"the first {per_source} {data.noun} of each source (training draws them shuffled)"
    names = data.names if isinstance(data, SFTDataModule) else ["data"]
    samples, totals, steps = token_samples(
        data.train_batches(0, 1), names, data.tokenizer.pad_id, per_source=per_source, count=count
    )
    read = f"one pass: {steps} optimizer steps" if count else f"the first {steps} optimizer steps"
    return samples, totals, f"the first {per_source} samples of each source, in training order ({read} read)"


def _prompt_lines(data: PromptDataModule, per_source: int) -> list[str]:
    """Prompt data (online RL): the rendered prompts; their completions are sampled while training."""
    items = data.prompt_items(range(len(data.prepare().train)))
    lines = ["prompts (the policy's sampled completions are what is trained; nothing here is supervised):"]
    shown: dict[str, int] = {}
    for item in items:
        shown[item.source] = shown.get(item.source, 0) + 1
        if shown[item.source] <= per_source:
            fields = ", ".join(f"{k}={v!r}" for k, v in item.fields.items())
            lines += [f"-- {item.source}: prompt {shown[item.source]} ({len(item.ids)} tokens; {fields})", item.text]
    return lines + ["", *table([["source", "prompts"], *([k, f"{v:,}"] for k, v in shown.items())])]


def preview_lines(data: DataModule, *, per_source: int, count: bool = True, style: Style = PLAIN) -> list[str]:
    """Everything ``plait data`` prints for a prepared data module (`trainer.preview`): the launch's
    data lines, the chat template, the legend, each source's first ``per_source`` samples marked,
    and a table of each source's counts with what was cut and the setting that keeps it."""
    lines = describe(data)
    if (chat := data.chat_format()) is not None:
        lines.append(chat.line())
    if isinstance(data, PromptDataModule):
        return [*lines, "", *_prompt_lines(data, per_source)]
    samples, totals, order = _sources(data, per_source, count)
    lines += [f"legend: {style.legend}", f"shown: {order}"]
    tokenizer = data.tokenizer
    for name, shown in samples.items():
        lines += ["", f"== {name} =="]
        for i, sample in enumerate(shown):
            one = show(sample, tokenizer, i // 2 + 1 if sample.title else i + 1, style)
            lines += ["", one.header, one.text, *one.notes]  # the text as it is (a final newline is a token)
    cuts = data.data_counts()
    rows = [["source", f"{data.noun} read", "dropped", "truncated", "supervised lost", "trained: pieces", "tokens"]]
    rows[0].append("supervised")
    for name, total in totals.items():
        c = cuts.get(name)
        prepared = [c.samples, c.dropped, c.truncated + c.prompts_cut, c.supervised_tokens_lost] if c else []
        trained = [total.samples, total.tokens, total.supervised]
        rows.append([name, *([f"{v:,}" for v in prepared] or ["-"] * 4), *(f"{v:,}" for v in trained)])
    lines += [
        "",
        (
            "per source (read: prepared rows and what preparation cut; trained: what the steps read above train, a"
            " sample split over rows counted once per row, pairs with both rows):"
        ),
        *table(rows),
    ]
    return lines + [f"{name}: to keep what was cut, {c.fix}" for name, c in cuts.items() if c.affected]
