"""`TextDataModule`: documents -> tokenizer -> packed rows -> global-batch loaders, cached on disk.

Preparation runs once in the launching process (so data errors surface before any process group
starts) and is cached under ``cache_dir``; every rank then loads the same cached rows.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from trainer.data import corpus
from trainer.data.packing import PackedRows, pack_documents
from trainer.data.sampler import GlobalBatchSampler, StatefulLoader
from trainer.data.tokenizer import Tokenizer, load_or_train


class DataError(ValueError):
    """Data that cannot be trained on; the message names the data and the fix."""


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: PackedRows
    val: PackedRows


class TextDataModule(L.LightningDataModule):
    """Packed causal-LM rows from the bundled corpus or a user's text/jsonl files.

    Args:
        sources: bundled corpora ("shakespeare", "kjv") used when ``path`` is None.
        path: the user's .txt/.jsonl files or directories (one path or a list); replaces ``sources``.
        text_key: field of a jsonl record holding the text.
        seq_len: tokens per packed row.
        tokenizer: path of a ``tokenizer.json`` to use; None trains a byte-level BPE on the corpus.
        vocab_size: vocabulary of the trained BPE.
        val_fraction: fraction of documents held out for validation.
        eval_rows: validation rows evaluated (the first ones of the held-out split).
        shuffle: shuffle training rows each epoch (seeded by seed and epoch).
        seed: seed of the split and of the shuffle.
        drop_last: drop the final partial global batch of each epoch.
        cache_dir: where tokenizers and packed rows are cached.
        global_batch_size: rows per optimizer step over all dp ranks (set by the trainer from
            ``train.global_batch_size``).
    """

    def __init__(
        self,
        *,
        sources: tuple[str, ...] | list[str] = ("shakespeare", "kjv"),
        path: str | list[str] | None = None,
        text_key: str = "text",
        seq_len: int = 256,
        tokenizer: str | None = None,
        vocab_size: int = 4096,
        val_fraction: float = 0.02,
        eval_rows: int = 64,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        cache_dir: str = "~/.cache/plait",
        global_batch_size: int = 32,
    ) -> None:
        super().__init__()
        self.sources = list(sources)
        self.paths = [path] if isinstance(path, str) else (list(path) if path else [])
        self.text_key = text_key
        self.seq_len, self.tokenizer_path, self.vocab_size = seq_len, tokenizer, vocab_size
        self.val_fraction, self.eval_rows = val_fraction, eval_rows
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.cache_dir = Path(os.path.expanduser(cache_dir))
        self.global_batch_size = global_batch_size
        self._prepared: PreparedData | None = None

    # ------------------------------------------------------------------------------ preparation
    def prepare(self) -> PreparedData:
        """Builds (or loads from the cache) the tokenizer and the packed train/val rows.

        Raises:
            DataError: no documents, or fewer training rows than one global batch.
        """
        if self._prepared is not None:
            return self._prepared
        documents = self._documents()
        fingerprint = _fingerprint([d.source + "\0" + d.title + "\0" + d.text for d in documents])
        train_docs, val_docs = corpus.split_train_val(documents, val_fraction=self.val_fraction, seed=self.seed)
        tokenizer = load_or_train(
            path=self.tokenizer_path,
            texts=[d.text for d in train_docs],
            vocab_size=self.vocab_size,
            cache_dir=self.cache_dir,
            # Keyed by the documents it is trained on: another seed or val_fraction is another split.
            corpus_fingerprint=_fingerprint([d.source + "\0" + d.title + "\0" + d.text for d in train_docs]),
        )
        key = _fingerprint([fingerprint, tokenizer.fingerprint, str(self.seq_len), str(self.val_fraction), str(self.seed)])
        cache_file = self.cache_dir / f"rows-{key}.pt"
        if cache_file.exists():
            rows = torch.load(cache_file, weights_only=True)
            train, val = PackedRows(**rows["train"]), PackedRows(**rows["val"])
        else:
            train, val = (self._pack(tokenizer, docs) for docs in (train_docs, val_docs))
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            torch.save({"train": vars(train), "val": vars(val)}, tmp)
            os.replace(tmp, cache_file)
        self._check(train, val)
        self._prepared = PreparedData(tokenizer=tokenizer, train=train, val=val)
        return self._prepared

    def _documents(self) -> list[corpus.Document]:
        try:
            documents = corpus.load_files(self.paths, text_key=self.text_key) if self.paths else corpus.load_bundled(self.sources)
        except (FileNotFoundError, ValueError) as err:
            if not self.paths:
                raise DataError(f"data.sources={self.sources}: {err}") from None
            fix = "fix the file, or point data.path at .txt/.jsonl files with text (null: the bundled corpus)"
            raise DataError(f"data.path={self.paths}: {err}; {fix}") from None
        if not documents:
            raise DataError("data: no documents found; set data.path=<file or dir> or data.sources=[shakespeare,kjv]")
        return documents

    def _pack(self, tokenizer: Tokenizer, docs: list[corpus.Document]) -> PackedRows:
        token_docs = tokenizer.encode_batch([d.text for d in docs]) if docs else []
        return pack_documents(token_docs, seq_len=self.seq_len, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)

    def _check(self, train: PackedRows, val: PackedRows) -> None:
        where = f"data.path={self.paths}" if self.paths else f"data.sources={self.sources}"
        if len(train) < self.global_batch_size:
            raise DataError(
                f"{where} gives {len(train)} training rows of data.seq_len={self.seq_len} tokens, fewer than one "
                f"global batch of train.global_batch_size={self.global_batch_size} rows; add data, or lower "
                f"train.global_batch_size or data.seq_len"
            )
        if self.val_fraction > 0 and len(val) == 0:
            raise DataError(f"{where}: the validation split is empty; raise data.val_fraction or add documents")

    @property
    def tokenizer(self) -> Tokenizer:
        return self.prepare().tokenizer

    def steps_per_epoch(self) -> int:
        full, _ = divmod(len(self.prepare().train), self.global_batch_size)
        return full

    # ------------------------------------------------------------------------------ loaders
    @override
    def setup(self, stage: str) -> None:
        self.prepare()

    @override
    def train_dataloader(self) -> StatefulLoader:
        prepared = self.prepare()
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.trainer else {"num_replicas": 1, "rank": 0}
        sampler = GlobalBatchSampler(
            len(prepared.train),
            global_batch_size=self.global_batch_size,
            dp_rank=dp["rank"],
            dp_size=dp["num_replicas"],
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        return StatefulLoader(prepared.train, sampler)

    def eval_dataloader(self) -> DataLoader:
        """This dp rank's share of the first ``eval_rows`` validation rows.

        The rows are trimmed to a multiple of dp (every rank must run the same number of forward
        passes under FSDP), so with ``min(eval_rows, validation rows)`` not divisible by dp the
        last few rows are not evaluated; keep ``data.eval_rows`` a multiple of the dp degree to
        compare validation losses across world sizes.
        """
        prepared = self.prepare()
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.trainer else {"num_replicas": 1, "rank": 0}
        num_rows = min(self.eval_rows, len(prepared.val))
        num_rows -= num_rows % dp["num_replicas"]
        per_rank = num_rows // dp["num_replicas"]
        indices = list(range(dp["rank"] * per_rank, (dp["rank"] + 1) * per_rank))
        micro = max(1, min(per_rank, 8))
        return DataLoader(torch.utils.data.Subset(prepared.val, indices), batch_size=micro, shuffle=False)


def _fingerprint(parts: list[str]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8"))
        digest.update(b"\x00\x01")
    return digest.hexdigest()[:16]


def describe(prepared: PreparedData) -> dict[str, int]:
    """Sizes of the prepared data, for logs and summary.json."""
    return {
        "vocab_size": prepared.tokenizer.vocab_size,
        "train_rows": len(prepared.train),
        "val_rows": len(prepared.val),
        "train_supervised_tokens": int(prepared.train.num_supervised_tokens()),
    }



