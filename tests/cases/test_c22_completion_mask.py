"""Case C22 — completion-only masking drops every label when the template contains the pad token
(huggingface/trl#1191).

Scenario: pad_id = eos_id = 2; response template ids [2, 50, 51]; sequence [5, 6, 2, 50, 51, 7, 8, 2].
Expected: labels [-100, -100, -100, -100, -100, 7, 8, 2] (3 supervised tokens: the answer and its
EOS), found on the input ids; a missing template raises instead of training 0 tokens silently;
a batch with 0 supervised tokens contributes loss 0, never NaN.

plait's chat formatting builds its mask the same way (per segment, on input ids), so an EOS that is
also the pad token is still supervised at the end of an assistant turn.
"""

import pytest
import torch

from trainer.data.chat import ChatError, completion_mask
from trainer.data.encode import labels_from_mask
from trainer.data.packing import IGNORE_INDEX
from trainer.objectives.sft import SFT

PAD = EOS = 2
TEMPLATE = [2, 50, 51]
SEQUENCE = [5, 6, 2, 50, 51, 7, 8, 2]


def test_template_with_the_pad_token_is_found_on_input_ids():
    mask = completion_mask(SEQUENCE, TEMPLATE)
    unshifted = [t if m else IGNORE_INDEX for t, m in zip(SEQUENCE, mask)]
    assert unshifted == [-100, -100, -100, -100, -100, 7, 8, 2]
    # plait's labels are pre-shifted (labels[t] is the target of position t): the same 3 targets.
    assert labels_from_mask(SEQUENCE, mask) == [-100, -100, -100, -100, 7, 8, 2, -100]


def test_missing_template_raises():
    with pytest.raises(ChatError, match="not found"):
        completion_mask([5, 6, 7], TEMPLATE)


def test_zero_supervised_tokens_give_loss_zero_not_nan():
    objective = SFT(groups=["only"])
    model = lambda ids, **_: torch.zeros(*ids.shape, 60, requires_grad=True)  # noqa: E731
    batch = {
        "input_ids": torch.tensor([SEQUENCE]),
        "labels": torch.full((1, 8), IGNORE_INDEX),
        "source_ids": torch.zeros(1, 8, dtype=torch.long),
    }
    loss = objective.loss_sum(model, batch) / objective.num_tokens(batch).clamp(min=1.0)  # as the Task divides
    assert loss.item() == 0.0 and not torch.isnan(loss)
    names, sums = objective.pop_sums()
    assert names == ["loss/only"] and sums.tolist() == [[0.0], [0.0]]
