"""Packing invariants, checked against a plain-Python reference packer on random samples."""

import random
import time

import numpy as np
import pytest
import torch

from trainer.data.encode import document_samples
from trainer.data.packing import IGNORE_INDEX, PackedRows, pack, shift_labels

PAD = 1000  # never a token id below, so pad positions are identifiable


def pack_documents(docs, *, seq_len, pad_id, eos_id):
    return pack(document_samples(docs, eos_id=eos_id), seq_len=seq_len, pad_id=pad_id)


def reference_pack(samples, seq_len, pad_id, policy):
    """The packing rules of the module docstring, written one token at a time."""
    rows = []  # each row: list of (input, label, position, doc)

    def new_row():
        rows.append([])
        return rows[-1]

    row = None
    for ids, labels in samples:
        if not ids:
            continue
        # whole: a sample that fits in a row but not in the rest of this one starts the next row
        if row is None or (policy == "whole" and len(ids) <= seq_len and len(row) + len(ids) > seq_len):
            row = new_row()
        doc = row[-1][3] + 1 if row else 0
        pos = 0
        for t, lab in zip(ids, labels):
            if len(row) == seq_len:
                row, doc, pos = new_row(), 0, 0
            row.append((t, lab, pos, doc))
            pos += 1
    out = {k: [] for k in ("input_ids", "labels", "position_ids", "document_ids")}
    for row in rows:
        pad_doc = row[-1][3] + 1
        row = row + [(pad_id, IGNORE_INDEX, p, pad_doc) for p in range(seq_len - len(row))]
        for key, column in zip(out, zip(*row)):
            out[key].append(list(column))
    return {k: torch.tensor(v, dtype=torch.long).reshape(-1, seq_len) for k, v in out.items()}


def random_samples(rng, n, max_len):
    samples = []
    for _ in range(n):
        ids = [rng.randrange(900) for _ in range(min(max_len, rng.choice([0, 1, 2, rng.randrange(1, max_len + 1)])))]
        samples.append((ids, [rng.choice([t, IGNORE_INDEX]) for t in shift_labels(ids)]))
    return samples


def check_invariants(rows: PackedRows, samples, seq_len):
    n = len(rows)
    for t in (rows.input_ids, rows.labels, rows.position_ids, rows.document_ids):
        assert t.dtype == torch.long and tuple(t.shape) == (n, seq_len)
    real = rows.input_ids != PAD
    assert torch.equal(rows.input_ids[real], torch.tensor([t for ids, _ in samples for t in ids], dtype=torch.long))
    assert torch.equal(rows.labels[real], torch.tensor([t for _, lab in samples for t in lab], dtype=torch.long))
    assert (rows.labels[~real] == IGNORE_INDEX).all()
    for i in range(n):
        r = rows[i]
        docs, pos = r["document_ids"], r["position_ids"]
        assert docs[0] == 0 and pos[0] == 0
        step = docs[1:] - docs[:-1]
        assert ((step == 0) | (step == 1)).all()
        # Positions count up inside a document and restart at each new one.
        assert torch.equal(pos[1:], torch.where(step == 1, 0, pos[:-1] + 1))
        if not real[i].all():  # the pad tail is one more document
            pad = ~real[i]
            assert pad[-1] and pad.sum() == seq_len - int(real[i].sum())
            assert (docs[pad] == docs[real[i]].max() + 1).all()


def test_shift_labels():
    assert shift_labels([5, 6, 7]) == [6, 7, IGNORE_INDEX]
    assert shift_labels([5]) == [IGNORE_INDEX]
    assert shift_labels([]) == []
    assert torch.equal(shift_labels(torch.tensor([5, 6, 7])), torch.tensor([6, 7, IGNORE_INDEX]))
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert torch.equal(shift_labels(batch), torch.tensor([[2, 3, IGNORE_INDEX], [5, 6, IGNORE_INDEX]]))
    assert torch.equal(batch, torch.tensor([[1, 2, 3], [4, 5, 6]]))  # input untouched


@pytest.mark.parametrize("policy", ["split", "whole"])
@pytest.mark.parametrize("seed", range(4))
def test_pack_matches_reference(seed, policy):
    rng = random.Random(seed)
    seq_len = rng.choice([1, 7, 16, 33])
    samples = random_samples(rng, 60, max_len=3 * seq_len + 2)
    rows = pack(samples, seq_len=seq_len, pad_id=PAD, policy=policy)
    expected = reference_pack(samples, seq_len, PAD, policy)
    for key, value in expected.items():
        assert torch.equal(getattr(rows, key), value), key
    check_invariants(rows, samples, seq_len)
    assert rows.num_supervised_tokens() == sum(t != IGNORE_INDEX for _, lab in samples for t in lab)
    if policy == "split":  # only the last row may have padding
        assert (rows.input_ids[:-1] != PAD).all()


def test_pack_no_split_keeps_samples_whole():
    a, b, c = [1, 2, 3], [4, 5, 6, 7], [8]
    rows = pack([(x, shift_labels(x)) for x in (a, b, c)], seq_len=5, pad_id=0, policy="whole")
    assert rows.input_ids.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert rows.document_ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    split = pack([(x, shift_labels(x)) for x in (a, b, c)], seq_len=5, pad_id=0)
    assert split.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert split.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 1]]
    assert split.document_ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 2, 2]]


def test_pack_errors_and_empty():
    with pytest.raises(ValueError, match="sample 1: 2 input_ids but 1 labels"):
        pack([([1], [2]), ([1, 2], [2])], seq_len=4, pad_id=0)
    with pytest.raises(ValueError, match="packing policy 'cut'"):
        pack([([1], [-100])], seq_len=4, pad_id=0, policy="cut")
    with pytest.raises(ValueError, match="seq_len"):
        pack([([1], [-100])], seq_len=0, pad_id=0)
    empty = pack([], seq_len=4, pad_id=0)
    assert len(empty) == 0 and tuple(empty.input_ids.shape) == (0, 4) and empty.num_supervised_tokens() == 0


def test_packed_rows_indexing():
    rows = pack([([1, 2, 3], [2, 3, IGNORE_INDEX])], seq_len=2, pad_id=0)
    assert len(rows) == 2
    assert set(rows[1]) == {"input_ids", "labels", "position_ids", "document_ids", "source_ids"}
    assert rows[1]["input_ids"].tolist() == [3, 0] and rows[1]["labels"].tolist() == [IGNORE_INDEX] * 2
    assert rows[1]["source_ids"].tolist() == [0, -1]  # the pad tail marked
    assert rows.num_supervised_tokens() == 2


def test_pack_documents_appends_eos_and_never_targets_across_documents():
    eos = 999
    rng = random.Random(0)
    docs = [[rng.randrange(900) for _ in range(rng.randrange(0, 40))] for _ in range(50)]
    rows = pack_documents(docs, seq_len=16, pad_id=PAD, eos_id=eos)
    samples = [(d + [eos], shift_labels(d + [eos])) for d in docs if d]
    expected = reference_pack(samples, 16, PAD, "split")
    for key, value in expected.items():
        assert torch.equal(getattr(rows, key), value), key
    check_invariants(rows, samples, 16)
    # Each document of n tokens gives n targets: n - 1 next tokens and its EOS.
    assert rows.num_supervised_tokens() == sum(len(d) for d in docs)
    # The EOS position predicts nothing; every target is the next token of the same document.
    assert (rows.labels[rows.input_ids == eos] == IGNORE_INDEX).all()
    flat_ids, flat_labels = rows.input_ids.flatten(), rows.labels.flatten()
    supervised = torch.nonzero(flat_labels != IGNORE_INDEX).flatten()
    assert torch.equal(flat_labels[supervised], flat_ids[supervised + 1])
    assert len(pack_documents([], seq_len=8, pad_id=0, eos_id=1)) == 0


def test_pack_documents_is_fast():
    """The default corpus is ~2.7 M tokens in ~2,000 documents; packing must not loop per token."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 4096, size=n).tolist() for n in rng.integers(200, 2500, size=2000)]
    elapsed = []
    for _ in range(3):  # the best of three: a shared machine's stalls are not the packer's
        start = time.perf_counter()
        rows = pack_documents(docs, seq_len=256, pad_id=1, eos_id=0)
        elapsed.append(time.perf_counter() - start)
    assert rows.num_supervised_tokens() == sum(map(len, docs))
    assert min(elapsed) < 2.0, f"pack_documents took {min(elapsed):.2f}s for {rows.num_supervised_tokens()} tokens"
