"""Preference-pair fixtures for the C24/C25 case tests and the unit tests: a pair's rows from
`trainer.data.encode.pair_rows` and logits with chosen per-token log-probs."""

import math

import torch
from torch import nn

from trainer.data.encode import pair_rows
from trainer.data.packing import IGNORE_INDEX

V = 16


def logits_for(labels_bt: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]`` logits whose log-softmax at each (row, position, label) is ``target_logp``."""
    b, s = labels_bt.shape
    logits = torch.zeros(b, s, V, dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            # log p(target) = -log(1 + (V-1) e^c) with the target's logit 0 and the others c.
            c = math.log(max(math.expm1(-float(target_logp[i, j])), 1e-30) / (V - 1))
            logits[i, j] = c
            if labels_bt[i, j] != IGNORE_INDEX:
                logits[i, j, labels_bt[i, j]] = 0.0
    return logits.float()


class FixedLogits(nn.Module):
    """A 'model' returning fixed ``[2P, T, V]`` logits, whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, position_ids_bt=None, document_ids_bt=None):  # noqa: ANN001, ANN201
        return self.logits


def pair_batch(prompt_logp, chosen_logp, rejected_logp, *, prompt=3, chosen=2, rejected=3, seq_len=12):
    rows, _ = pair_rows(
        list(range(2, 2 + prompt)), [7] * chosen, [8] * rejected, seq_len=seq_len, max_prompt_len=4, pad_id=1
    )
    labels = rows["labels"]  # [2, T]
    per_token = torch.zeros(2, seq_len)
    per_token[:, : prompt - 1] = prompt_logp / (prompt - 1)  # positions that predict prompt tokens 2..prompt
    per_token[0, prompt - 1 : prompt - 1 + chosen] = chosen_logp / chosen
    per_token[1, prompt - 1 : prompt - 1 + rejected] = rejected_logp / rejected
    # The prompt positions get real targets in the logits, as if a buggy mask summed them.
    full_labels = labels.clone()
    full_labels[:, : prompt - 1] = rows["input_ids"][:, 1:prompt]
    batch = {k: v[None] for k, v in rows.items()}
    return batch, logits_for(full_labels, per_token), full_labels
