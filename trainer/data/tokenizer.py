"""Tokenizer: a thin wrapper over HF ``tokenizers``, plus a cached byte-level BPE trainer.

The default tokenizer is a byte-level BPE (the GPT-2 scheme: every byte is a token, so any text
round-trips exactly) trained on the training corpus at run time and cached by a fingerprint of
the corpus and vocab size. Training 4k-8k vocabularies on the bundled ~9 MB corpus takes a few
seconds. Any Hugging Face ``tokenizer.json`` loads through ``Tokenizer.from_file``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainer.data.cache import digest, report_damaged, write_atomic

DEFAULT_EOS = "<|endoftext|>"
DEFAULT_PAD = "<|pad|>"
# Part of the cache key: bump when train_bpe changes what it produces for the same input.
_RECIPE = "bytelevel-bpe-v2"  # v2: trained on `pieces` (runs cut at MAX_RUN)
# Longest run of non-space (or space) characters the tokenizer sees at once. The BPE trainer's time
# grows faster than quadratically with a word's length (one 64 KiB word: 6 s, 256 KiB: 124 s, so an
# 8 MB line without whitespace stalled data preparation). The bundled data's longest run is 5650
# characters (glaive), so the bundled sets are tokenized exactly as before.
MAX_RUN = 8192
_LONG_RUN = re.compile(rf"\S{{{MAX_RUN + 1},}}|\s{{{MAX_RUN + 1},}}")
_SPACE = re.compile(r"\s")


def _may_have_long_run(text: str) -> bool:
    # A run longer than MAX_RUN covers one whole aligned window of MAX_RUN // 2 characters; checking
    # the windows stops at each one's first space: ~1000x cheaper than the regex over ordinary text.
    half = MAX_RUN // 2
    for start in range(0, len(text) - half + 1, half):
        window = text[start : start + half]
        if _SPACE.search(window) is None or window.isspace():
            return True
    return False


def pieces(text: str) -> list[str]:
    """``text`` cut every `MAX_RUN` characters inside runs longer than that (of non-space or of
    space characters); ``[text]`` when it has none. ``"".join(pieces(t)) == t``. Training and
    encoding both see the pieces, so a pathological line costs linear time and the tokenizer of
    an ordinary corpus is unchanged."""
    if len(text) <= MAX_RUN or not _may_have_long_run(text):
        return [text]
    cuts = [c for m in _LONG_RUN.finditer(text) for c in range(m.start() + MAX_RUN, m.end(), MAX_RUN)]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


class TokenizerFileError(ValueError):
    """A file that does not load as a Hugging Face ``tokenizer.json`` (bad JSON, truncated, empty,
    binary); ``reason`` is the parser's message."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.reason = reason
        super().__init__(f"{path} is not a tokenizer.json ({reason})")


def read_tokenizer_json(path: str | os.PathLike) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` of the file ``path``.

    Raises:
        TokenizerFileError: the file does not parse as a ``tokenizer.json`` (the parser's message).
    """
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception with its parser's message
        raise TokenizerFileError(path, str(err).splitlines()[0] if str(err) else type(err).__name__) from None


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the ids the trainer needs.

    Encoding never adds special tokens (no BOS/EOS post-processing): document boundaries are the
    packer's job. Decoding keeps special tokens, so an EOS stays visible in samples.

    Attributes:
        vocab_size: number of ids, including special tokens.
        eos_id: id of the end-of-document token.
        pad_id: id used for padding; the pad token's id if it is in the vocabulary, else ``eos_id``
            (padding is never a target and never attended to by real tokens, so sharing is safe).
    """

    def __init__(self, tok: tokenizers.Tokenizer, *, eos_token: str = DEFAULT_EOS, pad_token: str = DEFAULT_PAD):
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(
                f"the end-of-document token {eos_token!r} is not in the tokenizer's vocabulary; "
                f"name the tokenizer's own EOS token with data.tokenizer.eos_token=<token>"
            )
        pad_id = tok.token_to_id(pad_token)
        self._tok = tok
        self.eos_token = eos_token
        self.pad_token = eos_token if pad_id is None else pad_token
        self.eos_id: int = eos_id
        self.pad_id: int = eos_id if pad_id is None else pad_id
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._fingerprint: str | None = None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, encoded in `pieces` (one piece: exactly the tokenizer's encoding)."""
        parts = pieces(text)
        if len(parts) == 1:
            return self._tok.encode(text, add_special_tokens=False).ids
        return [i for ids in self._encode_many(parts) for i in ids]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts in parallel (Rust threads; ``RAYON_NUM_THREADS`` caps them), each in `pieces`."""
        split = [pieces(t) for t in texts]
        ids = self._encode_many([p for parts in split for p in parts])
        if len(ids) == len(split):
            return ids
        out, start = [], 0
        for parts in split:
            out.append([i for piece in ids[start : start + len(parts)] for i in piece])
            start += len(parts)
        return out

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we never use: ~25% faster.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; ``skip_special_tokens`` leaves the special tokens out (EOS, pad, ...)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the vocabulary's special tokens (added tokens marked special: EOS, pad,
        ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, ...)."""
        return frozenset(i for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

    @property
    def prepended_bos(self) -> int | None:
        """The token the tokenizer's post-processor puts before every text (Llama 3's
        ``<|begin_of_text|>``, Gemma's ``<bos>``) when special tokens are added; None when it adds
        none (plait's own tokenizers). `encode` never adds it."""
        added = self._tok.encode("", add_special_tokens=True).ids
        return added[0] if len(added) == 1 else None

    def to_str(self) -> str:
        """The tokenizer as HF ``tokenizer.json`` text."""
        return self._tok.to_str()

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` atomically (a reader never sees a half-written file)."""
        text = self.to_str()
        write_atomic(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))

    @classmethod
    def from_file(
        cls, path: str | os.PathLike, eos_token: str = DEFAULT_EOS, pad_token: str = DEFAULT_PAD
    ) -> Tokenizer:
        """Load any Hugging Face ``tokenizer.json``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            TokenizerFileError: the file is not a ``tokenizer.json`` (bad JSON, truncated, binary).
            ValueError: ``eos_token`` is not in the vocabulary (the message names the
                ``data.tokenizer.eos_token=`` override).
        """
        if not Path(path).is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        tok = read_tokenizer_json(path)
        if eos_token == DEFAULT_EOS and tok.token_to_id(eos_token) is None:
            # A Hugging Face tokenizer names its own EOS (</s>, <|end_of_text|>, ...) beside it.
            eos_token, pad_token = _hf_special_tokens(Path(path), eos_token, pad_token)
        return cls(tok, eos_token=eos_token, pad_token=pad_token)

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer JSON and of the EOS and pad tokens in use, 16 hex chars: changes
        whenever any id of an encoded row could change (a ``tokenizer_config.json`` that names
        another EOS changes the rows' separators, not the JSON)."""
        if self._fingerprint is None:
            self._fingerprint = digest(self.to_str(), self.eos_token, self.pad_token).hex()[:16]
        return self._fingerprint

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, pad_id={self.pad_id}, fingerprint={self.fingerprint})"


def train_bpe(
    texts: Iterable[str], *, vocab_size: int, eos_token: str = DEFAULT_EOS, pad_token: str = DEFAULT_PAD
) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 scheme) on ``texts``.

    The 256 byte tokens are always in the vocabulary, so ``decode(encode(x)) == x`` for any text
    and nothing maps to an unknown token. The special tokens take ids 0 (eos) and 1 (pad). The
    result is deterministic: the same texts and vocab_size give the same tokenizer JSON.

    Args:
        texts: the training texts (iterated once; each seen as its `pieces`).
        vocab_size: total ids including the 256 bytes and the 2 special tokens.
        eos_token, pad_token: the special tokens.

    Raises:
        ValueError: ``vocab_size`` leaves no room for a merge (must exceed 258).
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size <= len(alphabet) + 2:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE; it must exceed {len(alphabet) + 2}"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eos_token, pad_token],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator((p for text in texts for p in pieces(text)), trainer=trainer)
    return Tokenizer(tok, eos_token=eos_token, pad_token=pad_token)


def load_or_train(
    *,
    path: str | None,
    texts: Callable[[], Iterable[str]] | Sequence[str],
    vocab_size: int,
    cache_dir: Path,
    corpus_fingerprint: str,
    eos_token: str = DEFAULT_EOS,
) -> Tokenizer:
    """The run's tokenizer: the file at ``path``, else a BPE trained on ``texts`` and cached.

    The cache file is ``cache_dir/tokenizer-<key>.json`` where the key hashes the corpus
    fingerprint, the vocab size and the training recipe, so a different corpus or size never
    reuses a stale vocabulary. Writes are atomic, so ranks racing to fill the cache are safe
    (they write identical files); a cache file that does not load (truncated, overwritten) is
    said so on stderr and trained again.

    Args:
        path: a ``tokenizer.json`` to load; None trains or reuses the cached BPE.
        texts: the training texts, or a function returning them (only called on a cache miss).
        vocab_size: BPE vocabulary size (ignored when ``path`` is given).
        cache_dir: where trained tokenizers are kept; created if missing.
        corpus_fingerprint: identifies ``texts`` (e.g. ``corpus.fingerprint_documents``).
        eos_token: the end-of-document token.

    Raises:
        FileNotFoundError, TokenizerFileError, ValueError: ``path`` does not load (`Tokenizer.from_file`).
    """
    if path is not None:
        return Tokenizer.from_file(path, eos_token=eos_token)
    key = digest(_RECIPE, corpus_fingerprint, vocab_size, eos_token).hex()[:16]
    cached = Path(cache_dir) / f"tokenizer-{key}.json"
    if cached.is_file():
        try:
            return Tokenizer.from_file(cached, eos_token=eos_token)
        except TokenizerFileError as err:
            report_damaged(cached, err.reason)
    tok = train_bpe(texts() if callable(texts) else texts, vocab_size=vocab_size, eos_token=eos_token)
    tok.save(cached)
    return tok


def _hf_special_tokens(path: Path, eos_token: str, pad_token: str) -> tuple[str, str]:
    """``eos_token`` and ``pad_token`` of the ``tokenizer_config.json`` beside ``path`` (else the given ones)."""
    config_file = path.with_name("tokenizer_config.json")
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}

    def token(key: str, fallback: str) -> str:
        value = config.get(key) or fallback
        return value["content"] if isinstance(value, dict) else value

    return token("eos_token", eos_token), token("pad_token", pad_token)
