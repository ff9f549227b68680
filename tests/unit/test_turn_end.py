"""Answers end at the chat template's end of turn, not only at EOS.

A Qwen-style tokenizer's EOS is ``<|endoftext|>`` while its template ends every assistant turn with
``<|im_end|>`` and never writes the EOS: a model fine-tuned on its renderings emits ``<|im_end|>``
and then whatever follows. Before, ``plait chat`` answered past it until ``max_new_tokens``, exact
match scored ``4<|im_end|>\\n...`` against ``4`` (always 0), and GRPO's rewards read, and its policy
trained on, the text after the end of the turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from chat_templates import LLAMA3_STYLE, QWEN3_STYLE, raw_tokenizer
from harness import compose_config, fit
from omegaconf import OmegaConf
from rl_fixtures import ScriptedEngine
from torch import nn

from trainer.build import build_data
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE, JinjaTemplate, turn_end_ids
from trainer.data.tokenizer import Tokenizer
from trainer.evaluators.exact_match import ExactMatch, GenerationSet
from trainer.generate import reply
from trainer.rl.evaluate import completion_text
from trainer.sampling import greedy_batch, sample_batch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(raw_tokenizer())


def test_the_end_of_turn_is_the_special_token_that_closes_an_assistant_turn(tok: Tokenizer) -> None:
    qwen, llama = JinjaTemplate(QWEN3_STYLE, eos_token="<|endoftext|>"), JinjaTemplate(LLAMA3_STYLE, bos_token="")
    assert [tok.decode([i]) for i in turn_end_ids(tok, qwen)] == ["<|im_end|>"]
    assert [tok.decode([i]) for i in turn_end_ids(tok, llama)] == ["<|eot_id|>"]
    assert turn_end_ids(tok, JinjaTemplate(CHATML)) == turn_end_ids(tok, qwen)  # no generation blocks
    # plait's default template ends answers with the EOS itself; no template: nothing more.
    assert turn_end_ids(tok, JinjaTemplate(DEFAULT_CHAT_TEMPLATE, eos_token=tok.eos_token)) == ()
    assert turn_end_ids(tok, None) == ()
    # tokenizer_config.json's eos_token counts too (a template that writes it nowhere).
    plain = JinjaTemplate("{% for m in messages %}{{ m.content }}\n{% endfor %}", eos_token="<|eot_id|>")
    assert [tok.decode([i]) for i in turn_end_ids(tok, plain)] == ["<|eot_id|>"]


class Chain(nn.Module):
    """Greedy logits that follow ``table`` (token -> next token), the token itself otherwise."""

    max_seq_len = 64

    def __init__(self, table: dict[int, int], vocab: int) -> None:
        super().__init__()
        self.register_buffer("next", torch.arange(vocab))
        for token, nxt in table.items():
            self.next[token] = nxt
        self.vocab = vocab

    def forward(self, input_ids, position_ids_bt=None, document_ids_bt=None):  # noqa: ANN001, ANN201
        return nn.functional.one_hot(self.next[input_ids], self.vocab).float() * 10


def _answering_model(tok: Tokenizer, prompt_end: int) -> Chain:
    """After ``prompt_end`` the model says "Seven", ends its turn, then goes on with a new turn
    (never EOS), as a model fine-tuned on ChatML renderings does."""
    answer, (end,), more = tok.encode("Seven"), tok.encode("<|im_end|>"), tok.encode("<|im_start|>user")
    chain = [prompt_end, *answer, end, *more]
    assert len(set(chain)) == len(chain)
    return Chain(dict(zip(chain, chain[1:])), tok.vocab_size)


def test_decoding_stops_at_the_end_of_turn_and_exact_match_scores_the_answer(tok: Tokenizer) -> None:
    template = JinjaTemplate(QWEN3_STYLE, eos_token=tok.eos_token)
    stops = turn_end_ids(tok, template)
    prompt = tok.encode(template.render([{"role": "user", "content": "Name a prime."}], add_generation_prompt=True))
    model = _answering_model(tok, prompt[-1])
    seven, end = tok.encode("Seven"), stops[0]
    assert sample_batch(
        model, [prompt], max_new_tokens=12, eos_id=tok.eos_id, stop_ids=stops, temperature=0, use_cache=False
    ) == [[*seven, end]]
    assert greedy_batch(model, [prompt], max_new_tokens=12, eos_id=tok.eos_id, stop_ids=stops) == [seven]
    assert completion_text(tok, [*seven, end], stops) == "Seven"
    sets = {"primes": GenerationSet([prompt], ["Seven"])}
    assert ExactMatch(sets, tok, stops).evaluate(model, torch.device("cpu")) == {"val/exact_match/primes": 1.0}
    assert ExactMatch(sets, tok).evaluate(model, torch.device("cpu")) == {"val/exact_match/primes": 0.0}  # the old way


def test_chat_answers_end_at_the_templates_end_of_turn(tok: Tokenizer) -> None:
    template = JinjaTemplate(QWEN3_STYLE, eos_token=tok.eos_token)
    text = template.render([{"role": "user", "content": "Name a prime."}], add_generation_prompt=True)
    run = SimpleNamespace(model=_answering_model(tok, tok.encode(text)[-1]), tokenizer=tok)
    cfg = OmegaConf.create({"max_new_tokens": 12, "temperature": 0.0, "top_k": None, "kv_cache": False})
    assert reply(run, text, cfg, template) == "Seven"
    assert reply(run, text, cfg).startswith("Seven<|im_end|><|im_start|>user")  # continuing text: EOS alone


class StopRecorder(ScriptedEngine):
    """Scripted completions; appends the stop tokens each rollout asks for to the JSON list in
    ``record`` (a file: the engine is built by the run from its config)."""

    def __init__(self, record: str) -> None:
        super().__init__()
        self.record = Path(record)

    def generate(self, model: nn.Module, prompts: Sequence[Sequence[int]], *, params, **kwargs) -> list[list[int]]:  # noqa: ANN001
        seen = json.loads(self.record.read_text()) if self.record.exists() else []
        self.record.write_text(json.dumps([*seen, list(params.stop_token_ids)]))
        return super().generate(model, prompts, params=params, **kwargs)


def test_grpo_rollouts_and_held_out_rewards_stop_at_the_templates_end_of_turn(tok: Tokenizer, tmp_path: Path) -> None:
    record = tmp_path / "asked.json"
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    config = {"eos_token": "<|endoftext|>", "chat_template": CHATML}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    overrides = [
        "model=nano", "model.max_seq_len=64", "data.seq_len=48", "data.sources.addition.limit=32",
        "data.sources.addition.val_size=4", "objective.max_new_tokens=6", "objective.num_generations=4",
        "train.global_batch_size=16", "train.eval_every=0", "trainer.max_steps=1", "trainer.enable_progress_bar=false",
        "logger=none", "~callbacks.plots", "~callbacks.checkpoint", f"data.tokenizer={tmp_path / 'tokenizer.json'}",
        "data.template=tokenizer", "~objective.engine", f"+objective.engine={{_target_: test_turn_end.StopRecorder, record: {record}}}",
    ]  # fmt: skip
    (im_end,) = tok.encode("<|im_end|>")
    cfg = compose_config(overrides, recipe="grpo", tiny=False)
    data = build_data(cfg)
    assert data.stop_ids() == (im_end,)
    assert data.evaluators()[0].stop_ids == (im_end,)
    fit(cfg, tmp_path)
    assert json.loads(record.read_text()) == [[im_end]]
