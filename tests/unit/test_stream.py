"""Pretraining text from Hugging Face ``datasets`` tables: parquet shards and save_to_disk folders
as ``data.path`` documents, and the streamed source (``data=stream``) whose global batches resume
exactly from any position (also inside a document), slice the same over dp ranks, and end with
the stream."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.build import build_data
from trainer.compose import compose
from trainer.data import corpus

DOCS = [" ".join(f"w{(i * 7 + j) % 23}" for j in range(5 + (i * 5) % 17)) for i in range(30)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("shards")
    for s in range(3):
        datasets.Dataset.from_dict({"body": DOCS[s * 10 : (s + 1) * 10]}).to_parquet(str(root / f"part-{s}.parquet"))
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(root.parent / "saved"))
    return root


def _data(shards, *extra):
    cfg = compose(
        "pretrain",
        [
            "data=stream",
            f"data.path={shards}",
            "data.text_key=body",
            "data.eval_docs=3",
            "data.seq_len=16",
            "data.vocab_size=300",
            "train.global_batch_size=4",
            "model=nano",
            f"data.cache_dir={shards.parent / 'cache'}",
            *extra,
        ],
    )
    return build_data(cfg)


def test_tables_as_documents(shards):
    by_shards = corpus.load_files([str(shards)], text_key="body")
    assert [d.text for d in by_shards] == DOCS and by_shards[0].title == "part-0.parquet:1"
    assert [d.text for d in corpus.load_files([str(shards.parent / "saved")], text_key="body")] == DOCS
    with pytest.raises(
        ValueError, match=r"part-0.parquet, row 1: no column 'text' \(columns: \['body'\]\); set data.text_key="
    ):
        corpus.load_files([str(shards)])


def test_stream_resumes_exactly_from_every_position(shards):
    data = _data(shards)
    stream = data.train_batches(0, 1)
    run = list(stream.batches(stream.start()))
    assert run[-1][2] and not any(last for _, _, last in run[:-1])  # one pass, ending with the stream
    assert sum(p["packer"]["offset"] > 0 for _, p, _ in run) >= 2  # positions inside a document
    tokens = sum(int((b["input_ids"] != data.tokenizer.pad_id).sum()) for b, _, _ in run)
    assert tokens >= sum(len(data.tokenizer.encode(t)) + 1 for t in DOCS[3:]) - 4 * 16  # every training document
    for k in range(len(run) - 1):
        fresh = data.train_batches(0, 1)
        rest = list(fresh.batches(fresh.restore(copy.deepcopy(run[k][1]))))
        assert len(rest) == len(run) - k - 1
        for (got, _, _), (want, _, _) in zip(rest, run[k + 1 :]):
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_stream_batches_do_not_depend_on_dp(shards):
    data = _data(shards)
    whole = [b for b, _, _ in data.train_batches(0, 1).batches(data.train_batches(0, 1).start())]
    halves = [[b for b, _, _ in data.train_batches(r, 2).batches(data.train_batches(r, 2).start())] for r in (0, 1)]
    for one, a, b in zip(whole, *halves):
        torch.testing.assert_close(one["input_ids"], torch.cat([a["input_ids"], b["input_ids"]]), rtol=0, atol=0)
    held = data.eval_rows()["input_ids"]
    assert held.shape[1] == 16 and (held != data.tokenizer.pad_id).sum() > 0  # validation from the held-out documents


def test_holding_out_every_document_names_a_smaller_eval_docs(shards):
    """A small folder under the default data.eval_docs=64 said only that no training document was left."""
    from trainer.data.base import DataError

    with pytest.raises(DataError, match=r"\(it holds 30 documents\); hold out fewer, e.g. data.eval_docs=3"):
        _data(shards, "data.eval_docs=64").prepare()


def test_null_texts_are_empty_documents_in_tables_and_streams(tmp_path):
    """A null in the text column (a parquet null, an empty CSV cell): dropped as an empty document is.
    Before, pretraining refused the table as having 'no column text' (with the wrong fix,
    data.text_key), and data=stream crashed at the null's step (26 of 200) with no checkpoint."""
    import datasets

    texts = [*DOCS[:12], None, *DOCS[12:]]
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "nulls.parquet"))
    (tmp_path / "cells.csv").write_text("id,text\n1,first document\n2,\n3,third document\n")
    assert [d.text for d in corpus.load_files([str(tmp_path / "nulls.parquet")])] == DOCS
    assert [d.text for d in corpus.load_files([str(tmp_path / "cells.csv")])] == ["first document", "third document"]
    data = _data(tmp_path / "nulls.parquet", "data.text_key=text", "data.eval_docs=2")
    stream = data.train_batches(0, 1)
    run = list(stream.batches(stream.start()))  # to the stream's end, through the null
    tokens = sum(int((b["input_ids"] != data.tokenizer.pad_id).sum()) for b, _, _ in run)
    assert run[-1][2] and tokens >= sum(len(data.tokenizer.encode(t)) + 1 for t in DOCS[2:]) - 4 * 16


def test_an_empty_parquet_shard_in_a_folder_of_text_holds_no_document(tmp_path):
    """Refused the whole folder ('part-1.parquet: has no rows') though its other shard held 30."""
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "part-0.parquet"))
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})).to_parquet(
        str(tmp_path / "part-1.parquet")
    )
    assert [d.text for d in corpus.load_files([str(tmp_path)])] == DOCS
