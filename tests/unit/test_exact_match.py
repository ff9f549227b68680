"""The exact-match evaluator: greedy continuations of held-out prompts against their answers."""

from __future__ import annotations

import torch
from test_chat import byte_tokenizer
from torch import nn

from trainer.evaluators.exact_match import ExactMatch, GenerationSet


class Bigram(nn.Module):
    """Logits that put all mass on ``table[token]`` after each token (a fixed greedy continuation)."""

    def __init__(self, table: dict[int, int], vocab: int) -> None:
        super().__init__()
        self.register_buffer("next", torch.arange(vocab))
        for token, nxt in table.items():
            self.next[token] = nxt
        self.vocab = vocab

    def forward(self, input_ids, position_ids_bt=None, document_ids_bt=None):  # noqa: ANN001, ANN201
        return nn.functional.one_hot(self.next[input_ids], self.vocab).float()


def test_exact_match_scores_stripped_greedy_continuations_per_source():
    tok = byte_tokenizer()
    (gt,), (space,), (four,) = tok.encode(">"), tok.encode(" "), tok.encode("4")
    # After ">" the model says " 4" and stops: right for "2+2>", wrong for "2+3>".
    model = Bigram({gt: space, space: four, four: tok.eos_id}, tok.vocab_size)
    sets = {
        "math": GenerationSet([tok.encode("2+2>"), tok.encode("2+3>")], ["4", "5"]),
        "easy": GenerationSet([tok.encode("1+3>")], ["4"]),
        "empty": GenerationSet([], []),
    }
    scores = ExactMatch(sets, tok).evaluate(model, torch.device("cpu"))
    assert scores == {"val/exact_match/math": 0.5, "val/exact_match/easy": 1.0}
