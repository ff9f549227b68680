"""Case C21 — causal-LM labels shifted twice (huggingface/transformers#47394).

Scenario: a batch of 2 rows, [10, 11, 12, 13] and [20, 21, 22, 23], labels made from input_ids.
Expected: the targets for positions 0-2 are [11, 12, 13] and [21, 22, 23] and the last position
predicts nothing: shift_labels gives [11, 12, 13, -100] and [21, 22, 23, -100]. The bug (shift,
flatten, shift again) gives [12, 13, 21] and [22, 23, ignore]. The loss on pre-shifted labels,
F.cross_entropy(ignore_index=-100, reduction="sum") / count, equals a hand-computed single-shift CE.
"""

import torch
import torch.nn.functional as F

from trainer.data.packing import IGNORE_INDEX, shift_labels

INPUT_IDS = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
VOCAB = 32


def test_targets_are_the_next_token_of_the_same_row():
    labels = shift_labels(INPUT_IDS)
    assert labels.tolist() == [[11, 12, 13, IGNORE_INDEX], [21, 22, 23, IGNORE_INDEX]]
    # Never across rows: the last target of row 0 is not row 1's first token.
    assert labels[0, -1] == IGNORE_INDEX and 20 not in labels[0].tolist()
    assert [shift_labels(row) for row in INPUT_IDS.tolist()] == labels.tolist()


def test_loss_equals_hand_computed_single_shift_ce():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, VOCAB)
    labels = shift_labels(INPUT_IDS)
    count = int((labels != IGNORE_INDEX).sum())
    assert count == 6
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum") / count

    by_hand = 0.0
    for b in range(2):
        for t in range(3):  # position t predicts token t + 1 of the same row; t = 3 predicts nothing
            by_hand += -torch.log_softmax(logits[b, t], dim=-1)[INPUT_IDS[b, t + 1]].item()
    by_hand /= 6
    assert abs(loss.item() - by_hand) < 1e-6

    # The C21 bug: the model shifts and flattens (labels[:, 1:]), then the loss helper shifts the
    # flat vector again, so position t targets token t + 2 and row 0 borrows row 1's first token.
    once = INPUT_IDS[:, 1:].reshape(-1)
    twice = torch.cat([once[1:], torch.tensor([IGNORE_INDEX])]).reshape(2, 3)
    assert twice.tolist() == [[12, 13, 21], [22, 23, IGNORE_INDEX]]
    assert twice.tolist() != labels[:, :3].tolist()
    bug = F.cross_entropy(logits[:, :3].reshape(-1, VOCAB), twice.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum") / 5
    assert abs(bug.item() - by_hand) > 1e-3
