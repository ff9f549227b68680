"""Case C21 — causal-LM labels shifted twice (huggingface/transformers#47394).

Scenario: a batch of 2 rows, [10, 11, 12, 13] and [20, 21, 22, 23], labels made from input_ids.
Expected: the targets for positions 0-2 are [11, 12, 13] and [21, 22, 23] and the last position
predicts nothing: shift_labels gives [11, 12, 13, -100] and [21, 22, 23, -100]. The bug (shift,
flatten, shift again) gives [12, 13, 21] and [22, 23, ignore]. plait's CausalLM loss (whole logits
and chunked) on plait's labels (the rows as they are, and packed into one row of 8) equals the CE
the test computes by hand from the input ids, where position t predicts token t + 1.
"""

import pytest
import torch
from torch import nn

from trainer.data.packing import IGNORE_INDEX, pack, shift_labels
from trainer.objectives.pretrain import CausalLM

INPUT_IDS = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
VOCAB = 32


def test_targets_are_the_next_token_of_the_same_row():
    labels = shift_labels(INPUT_IDS)
    assert labels.tolist() == [[11, 12, 13, IGNORE_INDEX], [21, 22, 23, IGNORE_INDEX]]
    # Never across rows: the last target of row 0 is not row 1's first token.
    assert labels[0, -1] == IGNORE_INDEX and 20 not in labels[0].tolist()
    assert [shift_labels(row) for row in INPUT_IDS.tolist()] == labels.tolist()


class _TokenwiseLM(nn.Module):
    """A stand-in causal LM whose logits at t depend on token t only: ``output(embed(x_t))``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.output = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB, bias=False)

    def forward(self, input_ids_bt, *, return_hidden=False, **_):  # noqa: ANN001, ANN003, ANN201
        hidden_btd = self.embed(input_ids_bt)
        return hidden_btd if return_hidden else self.output(hidden_btd)


def _by_hand(model: nn.Module) -> float:
    """Mean CE over the 6 targets: position t of row b predicts INPUT_IDS[b, t + 1]; t = 3 nothing."""
    total = 0.0
    with torch.no_grad():
        for b in range(2):
            for t in range(3):
                logits_v = model.output.weight @ model.embed.weight[INPUT_IDS[b, t]]
                total -= torch.log_softmax(logits_v, dim=-1)[INPUT_IDS[b, t + 1]].item()
    return total / 6


@pytest.mark.parametrize("chunk", [0, 5], ids=["logits", "chunked"])
def test_plait_loss_on_plait_labels_is_the_single_shift_ce(chunk: int):
    """plait's labels (shift_labels, and pack of the two rows) through plait's CausalLM loss."""
    model, objective = _TokenwiseLM(), CausalLM(loss_chunk_tokens=chunk)
    expected = _by_hand(model)
    batch = {"input_ids": INPUT_IDS, "labels": shift_labels(INPUT_IDS)}
    packed = pack([(row, shift_labels(row)) for row in INPUT_IDS.tolist()], seq_len=8, pad_id=0)
    with torch.no_grad():
        for b in (batch, {k: v[None] for k, v in packed[0].items()}):
            assert objective.num_tokens(b).item() == 6
            assert abs(objective.loss_sum(model, b).item() / 6 - expected) < 1e-6

    # The C21 bug (shift, flatten, shift again): position t targets token t + 2, a different loss.
    once = INPUT_IDS[:, 1:].reshape(-1)
    twice = torch.cat([once[1:], torch.tensor([IGNORE_INDEX])]).reshape(2, 3)
    assert twice.tolist() == [[12, 13, 21], [22, 23, IGNORE_INDEX]]
    with torch.no_grad():
        bug = objective.loss_sum(model, {"input_ids": INPUT_IDS[:, :3], "labels": twice}) / 5
    assert abs(bug.item() - expected) > 1e-3
