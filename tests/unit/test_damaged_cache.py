"""A damaged cache file under PLAIT_CACHE_DIR is said so in one line and rebuilt: a truncated
rows file (torch.load failed inside the run), a truncated tokenizer (a traceback), rows whose
token ids lie beyond the vocabulary (an IndexError inside the embedding)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from harness import compose_config

from trainer.build import build_data
from trainer.data.cache import cached
from trainer.data.tokenizer import load_or_train


def test_a_truncated_cache_file_is_rebuilt(tmp_path: Path, capsys) -> None:
    path = tmp_path / "rows-x.pt"
    torch.save({"ids": torch.arange(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])
    value = cached(path, lambda: {"ids": torch.arange(3)})
    assert torch.equal(value["ids"], torch.arange(3))
    assert capsys.readouterr().err == (
        f"plait: cache file {path} is damaged (PytorchStreamReader failed reading zip archive: failed finding "
        "central directory); rebuilding it\n"
    )
    assert torch.equal(torch.load(path)["ids"], torch.arange(3))  # replaced: the next read is silent
    assert torch.equal(cached(path, lambda: {"ids": torch.arange(5)})["ids"], torch.arange(3))
    assert capsys.readouterr().err == ""


def test_a_truncated_tokenizer_cache_is_trained_again(tmp_path: Path, capsys) -> None:
    def load():
        return load_or_train(
            path=None, texts=["to be or not to be"] * 8, vocab_size=300, cache_dir=tmp_path, corpus_fingerprint="c"
        )

    trained = load()
    (cache_file,) = tmp_path.glob("tokenizer-*.json")
    cache_file.write_text(cache_file.read_text()[:1000])
    assert load().to_str() == trained.to_str()
    assert capsys.readouterr().err.startswith(f"plait: cache file {cache_file} is damaged (EOF while parsing")


def test_rows_with_a_token_id_beyond_the_vocabulary_are_rebuilt(tmp_path: Path, capsys) -> None:
    rng = random.Random(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(120)))
    cfg = compose_config(
        [f"data.path={tmp_path / 'corpus.txt'}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300"]
    )
    rows = build_data(cfg).prepare().train
    (cache_file,) = (tmp_path / "cache").glob("rows-*.pt")
    saved = torch.load(cache_file)
    saved["train"]["input_ids"][0, 0] = 99_999  # as rows of another tokenizer would hold
    torch.save(saved, cache_file)
    capsys.readouterr()
    again = build_data(cfg).prepare().train
    assert torch.equal(again.input_ids, rows.input_ids)
    err = capsys.readouterr().err
    assert err.startswith(f"plait: cache file {cache_file} is damaged (a token id in [") and err.count("\n") == 1, err
    assert err.endswith(", 99999] outside the vocabulary of 300); rebuilding it\n"), err


def test_sft_samples_with_a_token_id_beyond_the_vocabulary_are_rebuilt(tmp_path: Path, capsys) -> None:
    cfg = compose_config(
        [
            "model=nano",
            "data.seq_len=64",
            "data=synthetic",
            "data.sources.reversal.limit=40",
            "data.sources.sorting.limit=40",
            "data.sources.addition.limit=40",
            f"data.cache_dir={tmp_path}",
            "data.vocab_size=300",
        ],
        recipe="sft",
        tiny=False,
    )
    samples = build_data(cfg).prepare().train
    (cache_file,) = tmp_path.glob("sft-*.pt")
    saved = torch.load(cache_file)
    saved["sorting"][0][0][0][0] = 99_999  # source, split, sample, its ids
    torch.save(saved, cache_file)
    capsys.readouterr()
    again = build_data(cfg).prepare().train
    assert all((again[name].ids == samples[name].ids).all() for name in samples)
    assert capsys.readouterr().err.startswith(f"plait: cache file {cache_file} is damaged (a token id in [")


def test_rows_cached_by_other_data_code_are_built_again(tmp_path: Path, monkeypatch) -> None:
    """The cache key holds the version of plait's data code (`trainer.data.cache.code_version`): rows
    encoded before an encoding or packing fix are not read back by the fixed code (a reviewer's
    mutation of the SFT mask passed the learning tier with a warm cache: its rows were the old ones)."""
    from trainer.data import sft, text

    (tmp_path / "corpus.txt").write_text("\n".join(f"line {i} of a small corpus to pack" for i in range(200)))
    cfg = compose_config(
        [f"data.path={tmp_path / 'corpus.txt'}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300"]
    )
    build_data(cfg).prepare()
    build_data(cfg).prepare()  # the same code: read back
    assert len(list((tmp_path / "cache").glob("rows-*.pt"))) == 1
    monkeypatch.setattr(text, "code_version", lambda: "another version")
    build_data(cfg).prepare()
    assert len(list((tmp_path / "cache").glob("rows-*.pt"))) == 2

    sft_cfg = compose_config(
        ["model=nano", "data.seq_len=64", "data=synthetic", "data.sources.addition.limit=40", "data.vocab_size=300"]
        + ["data.sources.reversal.limit=40", "data.sources.sorting.limit=40", f"data.cache_dir={tmp_path / 'sft'}"],
        recipe="sft",
        tiny=False,
    )
    build_data(sft_cfg).prepare()
    monkeypatch.setattr(sft, "code_version", lambda: "another version")
    build_data(sft_cfg).prepare()
    assert len(list((tmp_path / "sft").glob("sft-*.pt"))) == 2


def test_the_code_version_reads_plain_python_files_only(tmp_path: Path) -> None:
    """An editor's lock file beside the sources (Emacs's ``.#text.py``, a dangling link) raised
    FileNotFoundError in every text and SFT run of an editable install (a reviewer's)."""
    from trainer.data.cache import sources_fingerprint

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "text.py").write_text("x = 1\n")
    before = sources_fingerprint(tmp_path)
    (tmp_path / "a" / ".#text.py").symlink_to("user@host.123:456")
    assert sources_fingerprint(tmp_path) == before
    (tmp_path / "a" / "text.py").write_text("x = 2\n")
    assert sources_fingerprint(tmp_path) != before
