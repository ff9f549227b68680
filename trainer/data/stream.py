"""`StreamDataModule`: pretraining text streamed from local tables (Hugging Face ``datasets``
streaming mode) -> tokenizer -> packed causal-LM rows, one pass, resumed exactly.

The table (``path``: parquet/arrow/jsonl/json/csv shards or a ``save_to_disk`` folder,
`trainer.data.tables.stream`) is read as an ``IterableDataset``, never materialised. Its first
``eval_docs`` documents are held out for validation (packed once; the training stream skips
them); without ``data.tokenizer`` a BPE is trained on the next ``tokenizer_docs`` documents.
Training documents (+ EOS) are tokenized as they are drawn and packed with the ``split`` policy
(every row full, no target across documents) by the one `Packer`, into global batches by
`PackedBatches`: the same pipeline as the SFT mixture, over one source named ``text``.

Exact resume: the packer's state is the stream's state *before* the document that straddles a
row boundary plus the offset into it, and the stream's state is the ``IterableDataset``'s own
``state_dict`` (shard and example index), so ``load_state_dict`` continues at the same token.
Every rank reads the whole stream and keeps its slice of each global batch, so the batches do
not depend on the world size (``datasets.distributed.split_dataset_by_node`` would give each rank
other documents, and a checkpoint one rank's position). The stream is one pass: the run ends at
``trainer.max_steps`` or when the stream ends; its length is not known ahead (`STREAM_BATCHES`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from torch import Tensor
from typing_extensions import Unpack, override

from strategies.core.ranges import NON_NEGATIVE, POSITIVE
from trainer.data import encode, tables
from trainer.data.base import DataError, DataModule, Settings
from trainer.data.cache import fingerprint
from trainer.data.loader import PackedBatches, Position
from trainer.data.packing import IGNORE_INDEX, Draw, PackedRows, Packer, pack
from trainer.data.tokenizer import Tokenizer

STREAM_BATCHES = 2**40  # the length a stream reports (unknown ahead; max_steps or its end stop the run)


class DocumentStream:
    """The documents of a streamed table as a `trainer.data.packing.SampleStream` of one source.

    Args:
        path: the table (`trainer.data.tables.stream`).
        text_key: the column holding each document's text.
        skip: documents left out at the start (the held-out ones).
        tokenizer: encodes each document as it is drawn (+ EOS).
    """

    names = ["text"]

    def __init__(self, path: str, *, text_key: str, skip: int, tokenizer: Tokenizer) -> None:
        self.path, self.text_key, self.tokenizer = path, text_key, tokenizer
        self.dataset = tables.stream(path).skip(skip) if skip else tables.stream(path)
        self._rows: Any = None

    def draw(self) -> Draw | None:
        if self._rows is None:
            self._rows = iter(self.dataset)
        for row in self._rows:
            text = document_text(row, self.text_key, self.path)
            if text.strip():
                ((ids, labels),) = encode.document_samples([self.tokenizer.encode(text)], eos_id=self.tokenizer.eos_id)
                labels = np.asarray(labels, dtype=np.int64)
                return Draw(0, np.asarray(ids, dtype=np.int64), labels, int((labels != IGNORE_INDEX).sum()))
        return None

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.dataset.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(copy.deepcopy(state))
        self._rows = None


def document_text(row: dict[str, Any], text_key: str, path: str) -> str:
    """The text of one streamed row; "" for a null one (an empty CSV cell), skipped as an empty
    document is.

    Raises:
        DataError: the row has no column ``text_key``, or a value that is not text there (naming
            the column and the fix).
    """
    if text_key not in row:
        raise DataError(
            f"data.path={path}: a row has no column {text_key!r} (columns: {sorted(row)}); set data.text_key"
        )
    text = row[text_key]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise DataError(
            f"data.path={path}: a row's {text_key!r} is {type(text).__name__}, not text; set data.text_key to the "
            "column that holds the document text"
        )
    return text


class StreamBatches(PackedBatches):
    """`PackedBatches` over a stream: its length is unknown ahead (`STREAM_BATCHES`)."""

    @override
    def num_batches(self, position: Position) -> int:
        return STREAM_BATCHES


@dataclass
class PreparedStream:
    """The tokenizer and the held-out rows; ``train`` is None (streamed, read as it is trained)."""

    tokenizer: Tokenizer
    val: PackedRows
    head: str  # fingerprint of the first training documents (those that train a BPE): the stream's start
    train: None = None


class StreamDataModule(DataModule):
    """Pretraining rows streamed from a local table (module docstring).

    Args:
        path: a parquet/arrow/jsonl/json/csv file, a folder of shards of one format, or a
            ``save_to_disk`` folder.
        text_key: the column holding the document text.
        eval_docs: documents held out at the start of the stream for validation.
        eval_rows: validation rows evaluated (the first ones packed from the held-out documents).
        tokenizer_docs: documents after the held-out ones that train the BPE (without ``data.tokenizer``).
        **settings: ``seq_len``, ``tokenizer``, ``vocab_size``, ``seed``, ``cache_dir``, ``run`` (`DataModule`).
    """

    def __init__(
        self,
        *,
        path: str,
        text_key: str = "text",
        eval_docs: Annotated[int, NON_NEGATIVE] = 64,
        eval_rows: Annotated[int, NON_NEGATIVE] = 64,
        tokenizer_docs: Annotated[int, POSITIVE] = 2000,
        **settings: Unpack[Settings],
    ) -> None:
        super().__init__(**settings)
        self.path, self.text_key = str(path), text_key
        self.eval_docs, self.eval_rows_count, self.tokenizer_docs = eval_docs, eval_rows, tokenizer_docs

    def _texts(self, start: int, count: int) -> list[str]:
        try:
            rows = itertools.islice(tables.stream(self.path), start, start + count)
            return [t for t in (document_text(r, self.text_key, self.path) for r in rows) if t.strip()]
        except (FileNotFoundError, ValueError) as err:
            if isinstance(err, DataError):
                raise
            raise DataError(f"data.path={self.path}: {err}; point data.path at a local table (data=stream)") from None

    @override
    def _prepare(self) -> PreparedStream:
        """The tokenizer and the packed validation rows.

        Raises:
            DataError: an unreadable table, a row without the text column, or no training document.
        """
        val_texts = self._texts(0, self.eval_docs)
        head = self._texts(self.eval_docs, self.tokenizer_docs)
        if not head:
            held = len(val_texts)
            raise DataError(
                f"data.path={self.path}: no training documents after the data.eval_docs={self.eval_docs} held out "
                f"(it holds {held} documents); hold out fewer, e.g. data.eval_docs={max(1, held // 10)}"
            )
        head_key = fingerprint("stream", *head)
        tokenizer = self.load_tokenizer(head, head_key)
        val = pack(encode.documents(tokenizer, val_texts), seq_len=self.seq_len, pad_id=tokenizer.pad_id)
        return PreparedStream(tokenizer=tokenizer, val=val, head=head_key)

    def _packer(self) -> Packer:
        stream = DocumentStream(
            self.path, text_key=self.text_key, skip=self.eval_docs, tokenizer=self.prepare().tokenizer
        )
        return Packer(stream, seq_len=self.seq_len, pad_id=self.tokenizer.pad_id, policy="split")

    @override
    def train_batches(self, dp_rank: int, dp_size: int) -> StreamBatches:
        self.prepare()
        return StreamBatches(
            self._packer,
            names=DocumentStream.names,
            global_batch_size=self.global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            balancer=self.balancer,
        )

    @override
    def finite_steps(self) -> int | None:
        return None  # one pass of unknown length: max_steps, or the stream's end, stops the run

    @override
    def end_reason(self, steps: int) -> str:
        """Why a stream ended the run after ``steps`` steps (found when it ends: its length is unknown ahead)."""
        return (
            f"data.path is read once and its training documents ran out after {steps} steps; add documents, "
            "or train epochs over them with data=text"
        )

    @override
    def eval_rows(self) -> dict[str, Tensor]:
        """The first ``eval_rows`` rows packed from the held-out documents."""
        return {k: v[: self.eval_rows_count] for k, v in vars(self.prepare().val).items()}
