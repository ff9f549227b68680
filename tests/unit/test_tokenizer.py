"""Byte-level BPE training, the Tokenizer wrapper and the tokenizer cache."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.data import tokenizer as tokenizer_mod
from trainer.data.default_corpus import load_shakespeare
from trainer.data.tokenizer import Tokenizer, load_or_train, train_bpe

REPO = Path(__file__).resolve().parents[2]
VOCAB = 600


@pytest.fixture(scope="module")
def texts():
    return [d.text for d in load_shakespeare()[:40]]  # ~200 KB of real English


@pytest.fixture(scope="module")
def tok(texts):
    return train_bpe(texts, vocab_size=VOCAB)


def test_train_bpe_is_deterministic(texts, tok):
    again = train_bpe(iter(texts), vocab_size=VOCAB)
    assert again.to_str() == tok.to_str()
    assert again.fingerprint == tok.fingerprint and len(tok.fingerprint) == 16
    assert train_bpe(texts[:20], vocab_size=VOCAB).fingerprint != tok.fingerprint


def test_train_bpe_is_deterministic_across_thread_counts(texts, tok):
    """The Rust trainer counts words in parallel; the result must not depend on how many threads."""
    code = (
        "from trainer.data.default_corpus import load_shakespeare\n"
        "from trainer.data.tokenizer import train_bpe\n"
        f"print(train_bpe([d.text for d in load_shakespeare()[:40]], vocab_size={VOCAB}).fingerprint)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == tok.fingerprint


def test_round_trip(texts, tok):
    samples = [
        texts[3][:2000],
        "  leading spaces, trailing tab\t\nnaïve café, 日本語, emoji 🙂, NUL \x00 and CRLF\r\n",
        "",
    ]
    for text in samples:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(samples) == [tok.encode(t) for t in samples]
    # Merges were learned: real English is much shorter in tokens than in bytes.
    assert len(tok.encode(texts[3])) < 0.5 * len(texts[3].encode())


def test_special_ids(tok):
    assert tok.vocab_size == VOCAB
    assert (tok.eos_id, tok.pad_id) == (0, 1)
    assert tok.encode("<|endoftext|>") == [tok.eos_id]
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"
    ids = tok.encode("To be, or not to be, that is the question.")
    assert tok.eos_id not in ids and tok.pad_id not in ids
    assert max(ids) < tok.vocab_size
    with pytest.raises(ValueError, match="too small"):
        train_bpe(["abc"], vocab_size=258)


def test_save_and_from_file(tmp_path, tok):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.from_file(path)
    assert loaded.fingerprint == tok.fingerprint
    assert (loaded.vocab_size, loaded.eos_id, loaded.pad_id) == (tok.vocab_size, tok.eos_id, tok.pad_id)
    assert loaded.encode("Now is the winter") == tok.encode("Now is the winter")
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left


def test_from_file_errors(tmp_path, texts):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Tokenizer.from_file(tmp_path / "missing.json")
    other = train_bpe(texts[:5], vocab_size=300, eos_token="</s>", pad_token="<unused>")
    path = tmp_path / "other.json"
    other.save(path)
    with pytest.raises(
        ValueError, match=r"'<\|endoftext\|>' is not in the tokenizer's vocabulary.*data\.tokenizer\.eos_token="
    ):
        Tokenizer.from_file(path)
    loaded = Tokenizer.from_file(path, eos_token="</s>")
    assert loaded.eos_id == 0
    assert loaded.pad_id == loaded.eos_id  # no "<|pad|>" in this vocabulary: pad falls back to eos


def test_load_or_train_caches(tmp_path, texts, monkeypatch):
    calls = []

    def corpus_texts():
        calls.append(1)
        return texts[:10]

    kwargs = dict(path=None, vocab_size=400, cache_dir=tmp_path / "cache", corpus_fingerprint="abc")
    first = load_or_train(texts=corpus_texts, **kwargs)
    files = sorted((tmp_path / "cache").iterdir())
    assert len(calls) == 1 and len(files) == 1 and files[0].name.startswith("tokenizer-")
    mtime = files[0].stat().st_mtime_ns

    def no_training(*args, **kw):
        raise AssertionError("retrained although the tokenizer was cached")

    with monkeypatch.context() as m:
        m.setattr(tokenizer_mod, "train_bpe", no_training)
        second = load_or_train(texts=corpus_texts, **kwargs)
    assert second.fingerprint == first.fingerprint
    assert len(calls) == 1 and files[0].stat().st_mtime_ns == mtime

    # Another corpus or vocab size is another cache entry.
    load_or_train(texts=corpus_texts, **{**kwargs, "corpus_fingerprint": "def"})
    load_or_train(texts=texts[:10], **{**kwargs, "vocab_size": 420})
    assert len(calls) == 2 and len(list((tmp_path / "cache").iterdir())) == 3

    # An explicit path wins and never trains.
    with monkeypatch.context() as m:
        m.setattr(tokenizer_mod, "train_bpe", no_training)
        loaded = load_or_train(texts=corpus_texts, **{**kwargs, "path": str(files[0]), "corpus_fingerprint": "zzz"})
    assert loaded.fingerprint == first.fingerprint


def test_pieces_cut_only_runs_longer_than_max_run():
    n = tokenizer_mod.MAX_RUN
    assert tokenizer_mod.pieces("word " * 5000) == ["word " * 5000]  # ordinary text: one piece
    text = "x " + "a" * (3 * n + 5) + " b" + " " * (n + 1) + "c"
    parts = tokenizer_mod.pieces(text)
    assert "".join(parts) == text
    # cuts every n characters from each long run's start: "x " + n a's | n | n | 5 a's " b" n spaces | " c"
    assert [len(p) for p in parts] == [n + 2, n, n, 5 + 2 + n, 1 + 1]


def test_a_line_without_whitespace_trains_and_encodes_in_linear_time(tok):
    """Before: the BPE trainer on one 256 KiB word took 124 s (64 KiB: 6 s; 8 MB: hours), which
    stalled data preparation; now the word is seen in MAX_RUN pieces (0.2 s)."""
    import time

    line = "ab" * (256 << 10) + "\n"
    start = time.perf_counter()
    trained = train_bpe([line, "hello world " * 50], vocab_size=300)
    ids = trained.encode_batch([line])[0]
    assert time.perf_counter() - start < 30
    assert trained.decode(ids) == line and trained.encode(line) == ids
    assert tok.decode(tok.encode(line)) == line


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"model": {"type": "BPE", ', "EOF while parsing"),
        (b"", "EOF while parsing a value"),
        (b"not json{", "expected ident"),
        (b"\xff\xfe\x00\x01binary", "stream did not contain valid UTF-8"),
    ],
)
def test_a_tokenizer_file_that_does_not_parse_is_refused_by_validate(tmp_path, content, reason):
    """Truncated, empty, bad JSON, binary: one problem naming the file and the fix (was a traceback)."""
    from harness import compose_config

    from trainer.config import ConfigError, validate

    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        validate(compose_config([f"data.tokenizer={path}"]))
    found = [p for p in err.value.problems if p.startswith(f"data.tokenizer={path} is not a tokenizer.json ({reason}")]
    assert found and found[0].endswith("); give a Hugging Face tokenizer.json, or null to train one"), (
        err.value.problems
    )


def test_rows_are_cached_by_the_eos_in_use_too(tmp_path):
    """The same tokenizer.json with another EOS named by its tokenizer_config.json: the prepared
    rows' separators change, so the cache must not hand back the old rows (a reviewer's run trained
    on 171 '</s>' separators while recording '<eot>' as its EOS)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from trainer.build import build_data
    from trainer.compose import compose

    docs = [f"document number {i} says hello" for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw.train_from_iterator(
        docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>", "<eot>"], initial_alphabet=alphabet)
    )
    (tmp_path / "tok").mkdir()
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))

    def separators(eos: str) -> tuple[int, int]:
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        overrides = [f"data.path={tmp_path / 'docs.jsonl'}", f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}",
                     "data.seq_len=32", "model=nano", f"data.cache_dir={tmp_path / 'cache'}", "train.global_batch_size=2"]  # fmt: skip
        data = build_data(compose("pretrain", overrides))
        ids = data.prepare().train.input_ids
        return int((ids == raw.token_to_id("</s>")).sum()), int((ids == raw.token_to_id("<eot>")).sum())

    first = separators("</s>")
    assert first[0] > 0 and first[1] == 0
    assert separators("<eot>") == (0, first[0])
