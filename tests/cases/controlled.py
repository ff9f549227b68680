"""A model and data whose per-token cross-entropy and supervised tokens the case tests choose.

`TableLM` maps each input token to a learned row of 2 logits; every supervised label is class 0,
so the CE of a token is ``log(1 + exp(row[1] - row[0]))``, set at init from ``ce[token]``.
`FixedRowsData` is plait's `TextDataModule` (its global-batch sampler and stateful loader) over
rows that a test function builds, instead of a tokenized corpus. Select them with::

    "~model", "+model._target_=controlled.TableLM", "+model.ce=[...]",
    "data._target_=controlled.FixedRowsData", "+data.rows=<module>.<function>"
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import get_method
from torch import nn
from typing_extensions import override

from trainer.data.packing import IGNORE_INDEX, PackedRows
from trainer.data.text import PreparedData, TextDataModule

# One SGD step at its full LR, unclipped, recording the gradients: updates stay exactly lr x grad.
ONE_SGD_STEP = (
    "train.max_grad_norm=0",
    "optim=sgd",
    "scheduler=constant",
    "scheduler.warmup_steps=0",
    "trainer.max_steps=1",
    "+callbacks.grads._target_=harness.GradRecorder",
)


def logit_gap(ce: float) -> float:
    """The logit of class 1 (class 0 at 0) that gives label 0 the cross-entropy ``ce``."""
    return math.log(math.expm1(ce))


class TableLM(nn.Module):
    """logits[b, t] = table[input_ids[b, t]] (2 classes); FSDP shards ``layers[0]`` like a block.

    Args:
        vocab_size: rows of the table (the trainer passes the data's vocabulary).
        ce: cross-entropy of label 0 for each token id at init; ids beyond the list get 1.0.
        max_seq_len: longest row accepted.
    """

    def __init__(self, *, vocab_size: int, ce: Sequence[float] = (), max_seq_len: int = 64) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        values = [float(c) for c in ce] + [1.0] * (vocab_size - len(ce))
        table = torch.zeros(vocab_size, 2)
        table[:, 1] = torch.tensor([logit_gap(c) for c in values[:vocab_size]])
        self.layers = nn.ModuleList([nn.Embedding(vocab_size, 2)])
        with torch.no_grad():
            self.layers[0].weight.copy_(table)
        self.num_train_forwards = 0
        # The model contract (strategies.core.model_contract) context parallelism reads: the sizes,
        # and an attention core to swap. A per-token table attends to nothing, so any core is right.
        self.vocab_size, self.dim, self.n_layers, self.ffn_dim = vocab_size, 2, 1, 2
        self.n_heads = self.n_kv_heads = 1
        self.tie_embeddings = False
        self.attention_core: Any = None

    def set_attention_core(self, core: Any) -> None:
        """Keeps ``core`` (context parallelism's ring attention); the table never calls it."""
        self.attention_core = core

    def forward(
        self,
        input_ids_bt: torch.Tensor,
        *,
        position_ids_bt: torch.Tensor | None = None,
        document_ids_bt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.training:
            self.num_train_forwards += 1
        return self.layers[0](input_ids_bt)


def token_ce(model: nn.Module, rows: PackedRows) -> torch.Tensor:
    """Per-position cross-entropy of ``rows`` under ``model``, flattened; 0 where the label is -100."""
    logits = model(rows.input_ids)
    return F.cross_entropy(logits.flatten(0, 1), rows.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")


def rows_from(inputs: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> PackedRows:
    """PackedRows of equal-length rows; positions count from 0 and each row is one document."""
    input_ids = torch.tensor(inputs, dtype=torch.long)
    label_ids = torch.tensor(labels, dtype=torch.long)
    assert input_ids.shape == label_ids.shape
    return PackedRows(
        input_ids=input_ids,
        labels=label_ids,
        position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
        document_ids=torch.zeros_like(input_ids),
    )


def row(tokens: Sequence[int], seq_len: int, pad: int = 0) -> tuple[list[int], list[int]]:
    """One row: ``tokens`` (each supervised with label 0), then pads with label -100."""
    padding = seq_len - len(tokens)
    return list(tokens) + [pad] * padding, [0] * len(tokens) + [IGNORE_INDEX] * padding


class FixedRowsData(TextDataModule):
    """plait's data module over the rows returned by ``rows`` (a dotted function path).

    Args:
        rows: ``"module.function"`` returning the training `PackedRows` (also used for validation).
        vocab: vocabulary size reported to the model builder.
        **kwargs: `TextDataModule` arguments (sampler settings: shuffle, seed, drop_last, ...).
    """

    def __init__(self, *, rows: str, vocab: int = 16, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows_fn: Callable[[], PackedRows] = get_method(rows)
        self.vocab = vocab

    @override
    def _prepare(self) -> PreparedData:
        train = self.rows_fn()
        return PreparedData(tokenizer=SimpleNamespace(vocab_size=self.vocab), train=train, val=train)


def data_overrides(rows: str, *, seq_len: int) -> list[str]:
    return ["data._target_=controlled.FixedRowsData", f"+data.rows={rows}", f"data.seq_len={seq_len}"]


def table_overrides(ce: Sequence[float]) -> list[str]:
    return ["~model", "+model._target_=controlled.TableLM", f"+model.ce=[{','.join(str(c) for c in ce)}]"]


class ForwardCounter(L.Callback):
    """Appends ``{"step": k, "forwards": n, "epoch": e}``: training forwards of this rank in step k."""

    def __init__(self) -> None:
        self._before = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._before = pl_module.model.num_train_forwards

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        forwards = pl_module.model.num_train_forwards - self._before
        pl_module.history.append({"step": trainer.global_step, "forwards": forwards, "epoch": trainer.current_epoch})
