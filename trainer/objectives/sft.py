"""SFT objective: the causal-LM loss on assistant tokens, also summed per source.

The data pipeline already puts -100 on every label that is not an assistant token (trainer.data
.chat), so the loss is the pretraining one. What SFT adds is the per-source split: batches carry
``source_ids`` ([b, s], the source index of each token, -1 on padding) and the objective keeps
per-source sums of token losses and supervised-token counts. The Task collects them after each
step and each evaluation (`pop_sums`), reduces them over data-parallel ranks and logs each
source's token-weighted loss (``train/loss/<source>``, ``val/loss/<source>``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from strategies.core.model_contract import model_inputs
from trainer.objectives.pretrain import IGNORE_INDEX, CausalLM


class SFT(CausalLM):
    """Causal-LM loss with per-source sums.

    Args:
        groups: the source names, in source-index order (the recipe passes the keys of
            ``data.sources``).
    """

    def __init__(self, groups: Sequence[str] = ()) -> None:
        self.groups = list(groups)
        self._sums: torch.Tensor | None = None  # [2, G]: summed loss, supervised tokens

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed token loss of ``batch`` (0-dim fp32); adds per-source sums when it has ``source_ids``."""
        logits = model(batch["input_ids"], **model_inputs(model, batch))
        labels = batch["labels"].flatten()
        token_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
        if isinstance(token_loss, DTensor):  # vocabulary-sharded logits (tensor parallelism's loss parallel)
            token_loss = token_loss.full_tensor()
        if "source_ids" in batch and self.groups:
            self._accumulate(token_loss.detach(), labels, batch["source_ids"].flatten())
        return token_loss.sum()

    def _accumulate(self, token_loss: torch.Tensor, labels: torch.Tensor, source_ids: torch.Tensor) -> None:
        supervised = (labels != IGNORE_INDEX) & (source_ids >= 0)
        index = source_ids.clamp(min=0)
        sums = torch.zeros(2, len(self.groups), dtype=torch.float32, device=token_loss.device)  # also under bf16-true
        sums[0].index_add_(0, index, torch.where(supervised, token_loss.float(), 0.0))
        sums[1].index_add_(0, index, supervised.float())
        self._sums = sums if self._sums is None else self._sums + sums

    @override
    def pop_sums(self) -> tuple[list[str], torch.Tensor] | None:
        """``(["loss/<group>", ...], [2, G] tensor)`` of loss sums and token counts since the last
        call (this rank's share; the Task all-reduces it), or None without groups."""
        sums, self._sums = self._sums, None
        if not self.groups:
            return None
        if sums is None:
            sums = torch.zeros(2, len(self.groups), dtype=torch.float32)
        return [f"loss/{name}" for name in self.groups], sums
