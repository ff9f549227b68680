"""`TextDataModule`: documents -> tokenizer -> packed causal-LM rows -> shuffled global batches.

Documents are the bundled corpus (``sources``) or the user's ``.txt``/``.jsonl`` files
(``path``), split into training and held-out documents by ``val_fraction``
(trainer.data.default_corpus, trainer.data.corpus). Each document + EOS is one sample; samples are packed with the ``split``
policy (every row full, no target across documents) and cached; epochs shuffle the rows.

A corpus too small to hold out whole documents (``val_fraction`` x documents < 1: one ``.txt``
file, a few documents) holds out rows instead: the last ``val_fraction`` of the packed rows (at
least one), the tail of the token stream as nanoGPT holds out the end of Shakespeare; the
tokenizer is then trained on all of the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from torch import Tensor
from typing_extensions import Unpack, override

from strategies.core.ranges import NON_NEGATIVE, Range
from trainer.data import corpus, default_corpus, encode
from trainer.data.base import DataError, DataModule, Settings
from trainer.data.cache import cached, code_version, fingerprint
from trainer.data.loader import RowBatches
from trainer.data.packing import IGNORE_INDEX, PackedRows, pack
from trainer.data.sampler import GlobalBatchSampler
from trainer.data.tokenizer import Tokenizer


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: PackedRows
    val: PackedRows
    documents: tuple[int, int] | None = None  # (training, held-out) documents, for the data summary


class TextDataModule(DataModule):
    """Packed causal-LM rows from the bundled corpus or a user's text/jsonl files.

    Args:
        sources: bundled corpora ("shakespeare", "kjv") used when ``path`` is None.
        path: the user's .txt/.jsonl files or directories (one path or a list); replaces ``sources``.
        text_key: field of a jsonl record holding the text.
        val_fraction: fraction of documents held out for validation (of rows when fewer than
            ``1 / val_fraction`` documents, see the module docstring).
        eval_rows: validation rows evaluated (the first ones of the held-out split).
        shuffle: shuffle training rows each epoch (seeded by seed and epoch).
        drop_last: drop the final partial global batch of each epoch.
        **settings: ``seq_len`` (tokens per packed row), ``tokenizer``, ``vocab_size``, ``seed``
            (of the split and the shuffle), ``cache_dir``, ``run`` (`DataModule`).
    """

    def __init__(
        self,
        *,
        sources: tuple[str, ...] | list[str] = ("shakespeare", "kjv"),
        path: str | list[str] | None = None,
        text_key: str = "text",
        val_fraction: Annotated[float, Range(min=0, max=1, max_open=True)] = 0.02,
        eval_rows: Annotated[int, NON_NEGATIVE] = 64,
        shuffle: bool = True,
        drop_last: bool = True,
        **settings: Unpack[Settings],
    ) -> None:
        super().__init__(**settings)
        self.sources = list(sources)
        self.paths = [path] if isinstance(path, str) else (list(path) if path else [])
        self.text_key = text_key
        self.val_fraction, self.eval_rows_count = val_fraction, eval_rows
        self.shuffle, self.drop_last = shuffle, drop_last

    @override
    def _prepare(self) -> PreparedData:
        """The tokenizer and the packed train/val rows (cached).

        Raises:
            DataError: no documents, or fewer training rows than one global batch.
        """
        documents = self._documents()
        by_rows = 0 < self.val_fraction and len(documents) * self.val_fraction < 1
        if by_rows:
            train_docs, val_docs = documents, []
        else:
            train_docs, val_docs = corpus.split_train_val(documents, val_fraction=self.val_fraction, seed=self.seed)
        # Keyed by the documents it is trained on: another seed or val_fraction is another split.
        tokenizer = self.load_tokenizer([d.text for d in train_docs], corpus.fingerprint_documents(train_docs))
        key = fingerprint(
            corpus.fingerprint_documents(documents),
            tokenizer.fingerprint,
            str(self.seq_len),
            str(self.val_fraction),
            str(self.seed),
            *(["rows, the cut label ignored"] if by_rows else []),
            code_version(),
        )

        def build() -> dict[str, dict[str, Tensor]]:
            packed = [
                pack(encode.documents(tokenizer, [d.text for d in docs]), seq_len=self.seq_len, pad_id=tokenizer.pad_id)
                for docs in (train_docs, val_docs)
            ]
            if by_rows:  # the last rows of the one packed stream
                cut = max(0, len(packed[0]) - max(1, round(self.val_fraction * len(packed[0]))))
                rows = vars(packed[0])
                train = {k: v[:cut].clone() for k, v in rows.items()}
                if cut:  # its last label is the first held-out token (labels are shifted across rows)
                    train["labels"][-1, -1] = IGNORE_INDEX
                return {"train": train, "val": {k: v[cut:] for k, v in rows.items()}}
            return {"train": vars(packed[0]), "val": vars(packed[1])}

        def damage(rows: dict[str, dict[str, Tensor]]) -> str | None:  # a cache file overwritten by other rows
            problems = (PackedRows(**split).token_id_problem(tokenizer.vocab_size) for split in rows.values())
            return next((p for p in problems if p is not None), None)

        rows = cached(self.cache_dir / f"rows-{key}.pt", build, check=damage)
        train, val = PackedRows(**rows["train"]), PackedRows(**rows["val"])
        self._check(train, val)
        return PreparedData(tokenizer=tokenizer, train=train, val=val, documents=(len(train_docs), len(val_docs)))

    def _documents(self) -> list[corpus.Document]:
        try:
            documents = (
                corpus.load_files(self.paths, text_key=self.text_key)
                if self.paths
                else default_corpus.load_bundled(self.sources)
            )
        except (FileNotFoundError, ValueError) as err:
            if not self.paths:
                raise DataError(f"data.sources={self.sources}: {err}") from None
            fix = "fix the file, or point data.path at .txt/.jsonl files with text (null: the bundled corpus)"
            raise DataError(f"data.path={self.paths}: {err}; {fix}") from None
        if not documents:
            raise DataError("data: no documents found; set data.path=<file or dir> or data.sources=[shakespeare,kjv]")
        return documents

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

    @override
    def train_batches(self, dp_rank: int, dp_size: int) -> RowBatches:
        train = self.prepare().train
        sampler = GlobalBatchSampler(
            len(train),
            global_batch_size=self.global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        return RowBatches(vars(train), sampler, self.balancer)

    @override
    def eval_rows(self) -> dict[str, Tensor]:
        """The first ``eval_rows`` validation rows (each evaluated once, on any number of ranks)."""
        return {k: v[: self.eval_rows_count] for k, v in vars(self.prepare().val).items()}
