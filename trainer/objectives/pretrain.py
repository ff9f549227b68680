"""Causal language-modelling objective: summed next-token cross-entropy over supervised tokens.

Labels are pre-shifted by the data pipeline (``labels[t]`` is the target of position t, -100 where
there is none), so nothing here shifts again (case C21).
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from strategies.core.model_contract import model_inputs, optional
from strategies.core.ranges import NON_NEGATIVE
from strategies.core.resolved import ResolvedRun
from strategies.transforms.lora import linear_operands
from trainer.objectives.chunked_loss import chunked_token_loss_sum
from trainer.protocols import Objective

IGNORE_INDEX = -100


def token_loss_sum(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy (nats) over positions whose label is not -100; fp32, 0-dim.

    A batch without supervised tokens gives exactly 0 (never 0/0). ``logits_btv`` may be a DTensor
    sharded on V (call it inside ``loss_parallel()`` then); the result is a plain tensor.
    """
    loss = F.cross_entropy(
        logits_btv.flatten(0, 1).float(), labels_bt.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    # Vocabulary-sharded logits (tensor parallelism's loss parallel) give a replicated DTensor.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class CausalLM(Objective):
    """The pretraining objective. The Task divides `loss_sum` by the step's global `num_tokens`.

    Batches are dicts with ``input_ids``, ``labels``, ``position_ids``, ``document_ids`` ([b, s] int64).

    Args:
        loss_chunk_tokens: 0 computes the logits of the whole batch; N > 0 applies the model's LM
            head (``model.output``) and the cross-entropy N tokens at a time, gradients included,
            so the ``[B, T, V]`` logits never exist (`chunked_token_loss_sum`; long contexts);
            None: `CUDA_CHUNK_TOKENS` on CUDA (a plain, not vocabulary-sharded head), 0 elsewhere.
    """

    loss_chunk_tokens: int | None = 0  # also for subclasses that do not call this __init__
    CUDA_CHUNK_TOKENS = 8192  # [8192, V] fp32 logits at a time: 4 GiB at V = 128k

    def __init__(self, loss_chunk_tokens: Annotated[int, NON_NEGATIVE] | None = None) -> None:
        if loss_chunk_tokens is not None and loss_chunk_tokens < 0:
            raise ValueError(f"objective.loss_chunk_tokens={loss_chunk_tokens} must be >= 0 (0: off, null: auto)")
        self.loss_chunk_tokens = loss_chunk_tokens

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """`Objective.problems`, and ``loss_chunk_tokens`` under tp > 1 (loss parallel keeps the
        logits sharded by vocabulary there; the chunked loss needs the whole head)."""
        problems = super().problems(run, node)
        if run is not None and run.dims.tp > 1 and node.get("loss_chunk_tokens"):
            problems.append(
                f"objective.loss_chunk_tokens={node.loss_chunk_tokens} needs tp=1 (with tp > 1 loss parallel already "
                "keeps the logits sharded by vocabulary); use objective.loss_chunk_tokens=0"
            )
        return problems

    def chunk_tokens(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
        """Tokens per loss chunk for this batch (0: whole logits); resolves the automatic None."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        head = optional(model, "output")  # a pipeline stage's replay of its logits has no head
        plain = isinstance(head, nn.Linear) and not isinstance(head.weight, DTensor)
        return self.CUDA_CHUNK_TOKENS if plain and batch["input_ids"].is_cuda else 0

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Supervised tokens in ``batch`` (0-dim fp32)."""
        return (batch["labels"] != IGNORE_INDEX).sum().float()

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed token loss of ``batch`` under ``model`` (0-dim fp32)."""
        ids = model_inputs(model, batch)
        chunk = self.chunk_tokens(model, batch)
        if chunk:
            hidden = model(batch["input_ids"], **ids, return_hidden=True)
            # The head's weight is applied here, not by calling the head: a LoRA adapter on it (a
            # hook) or a QLoRA base (packed codes) must come along (linear_operands).
            hidden, weight = linear_operands(model.output, hidden)
            return chunked_token_loss_sum(hidden, weight, batch["labels"], chunk_tokens=chunk)
        logits = model(batch["input_ids"], **ids)
        return token_loss_sum(logits, batch["labels"])
