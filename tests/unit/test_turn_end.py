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
from test_exact_match import Bigram
from torch import nn

from trainer.batch_sampling import greedy_batch, sample_batch
from trainer.build import build_data
from trainer.data.answer_end import turn_end_ids, turn_end_text
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE, JinjaTemplate
from trainer.data.tokenizer import Tokenizer
from trainer.evaluators.exact_match import ExactMatch, GenerationSet
from trainer.generate import reply
from trainer.rl.evaluate import completion_text

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


@pytest.mark.parametrize("before", ["", " ", "\n"])
def test_whitespace_or_a_second_special_token_around_the_marker_still_stops_at_it(tok: Tokenizer, before: str) -> None:
    """A template writing a space or a newline before <|im_end|> gave neither a stop id nor a stop
    text (a reviewer's probe); one writing <|im_end|> and then the EOS was cut as text with a false
    warning, though <|im_end|> stops it."""
    (im_end,) = tok.encode("<|im_end|>")
    for after in ("<|im_end|>\n", "<|im_end|><|endoftext|>"):
        source = CHATML.replace("{{ m.content }}<|im_end|>\n", f"{{{{ m.content }}}}{before}{after}")
        template = JinjaTemplate(source)
        assert (turn_end_ids(tok, template), turn_end_text(tok, template)) == ((im_end,), ()), (before, after)


def test_a_template_that_requires_a_system_turn_is_probed_with_one(tok: Tokenizer) -> None:
    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}" + CHATML
    (im_end,) = tok.encode("<|im_end|>")
    assert turn_end_ids(tok, JinjaTemplate(strict)) == (im_end,)


class Chain(Bigram):
    """`Bigram`'s fixed greedy continuation, with the context length the samplers read."""

    max_seq_len = 64


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


class Scripted(nn.Module):
    """Greedy decoding writes ``script`` after a prompt of ``prompt_len`` tokens (any token repeated),
    then the script's last token forever."""

    max_seq_len = 128

    def __init__(self, script: Sequence[int], prompt_len: int, vocab_size: int) -> None:
        super().__init__()
        self.script, self.prompt_len, self.vocab_size = list(script), prompt_len, vocab_size

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        step = min(input_ids.shape[1] - self.prompt_len, len(self.script) - 1)
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        logits[..., self.script[step]] = 1.0
        return logits


def test_chat_answers_end_at_a_marker_spelled_in_several_tokens(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``plait generate chat=true`` and ``plait chat`` with a tokenizer that spells the template's
    ``<|im_end|>`` in several tokens: the answer is cut at its text, and decoding stops there
    (before: "Seven<|im_end|>\n<|im_start|>user..." up to max_new_tokens, a reviewer's). Mutation:
    reply without ``stop_text`` -> the whole script."""
    from hf_checkpoints import write_tokenizer

    from trainer.generate import chat_template

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    template = JinjaTemplate(CHATML, eos_token="<|endoftext|>")
    assert turn_end_ids(tok, template) == () and turn_end_text(tok, template) == ("<|im_end|>",)
    text = template.render([{"role": "user", "content": "Name a prime."}], add_generation_prompt=True)
    script = tok.encode("Seven<|im_end|>\n<|im_start|>user\nAnd another?<|im_end|>\n")
    model = Scripted(script, len(tok.encode(text)), tok.vocab_size)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    run = SimpleNamespace(model=model, tokenizer=tok)
    cfg = OmegaConf.create({"max_new_tokens": 100, "temperature": 0.0, "top_k": None, "kv_cache": False})
    assert reply(run, text, cfg, template) == "Seven"
    assert len(calls) == len(tok.encode("Seven<|im_end|>"))  # stopped at the marker, not at max_new_tokens
    # The command says so once, with the template it names.
    run = SimpleNamespace(model=model, tokenizer=tok, run=SimpleNamespace(path=tmp_path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("trainer.generate.trained_chat_template", lambda _run: template)
        chat_template(run)
    assert "end of turn '<|im_end|>' is several tokens of this tokenizer" in capsys.readouterr().err


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


GRPO_TINY = (
    "model=nano", "model.max_seq_len=64", "data.seq_len=48", "data.sources.addition.limit=32",
    "data.sources.addition.val_size=4", "objective.max_new_tokens=6", "objective.num_generations=4",
    "train.global_batch_size=16", "train.eval_every=0", "trainer.max_steps=1", "trainer.enable_progress_bar=false",
    "logger=none", "~callbacks.plots", "~callbacks.checkpoint", "data.template=tokenizer", "~objective.engine",
)  # fmt: skip


def _supervised_end(data, tok: Tokenizer) -> str:  # noqa: ANN001
    """The supervised text of the first held-out row of ``data.eval_rows()``."""
    return tok.decode([t for t in data.eval_rows()["labels"][0].tolist() if t != -100])


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
    assert data.stop_ids() == (im_end,) and data.stop_texts() == ()
    assert data.evaluators()[0].stop_ids == (im_end,)
    # val/loss scores the answer and the end of turn the template writes, not an EOS it never writes.
    scored = _supervised_end(data, tok)
    assert scored.endswith("<|im_end|>\n") and "<|endoftext|>" not in scored
    fit(cfg, tmp_path)
    assert json.loads(record.read_text()) == [[im_end]]


def record_completions(prompts: list[str], completions: list[str], *, path: str, **fields) -> list[float]:  # noqa: ANN003
    """A reward of weight 0 that appends the texts it is given to the JSON list in ``path``."""
    seen = json.loads(Path(path).read_text()) if Path(path).exists() else []
    Path(path).write_text(json.dumps([*seen, *completions]))
    return [0.0] * len(completions)


class SaysSeven(ScriptedEngine):
    """Every completion is "Seven<|im_end|>" and a new turn after it, in the run's tokenizer (from ``tokenizer``)."""

    def __init__(self, tokenizer: str) -> None:
        super().__init__()
        self.ids = Tokenizer.from_file(tokenizer).encode("Seven<|im_end|>\n<|im_start|>user")

    def generate(self, model, prompts, *, params, **kwargs) -> list[list[int]]:  # noqa: ANN001
        return [self.ids[: params.max_new_tokens] for _ in prompts]


def test_an_end_of_turn_spelled_in_several_tokens_cuts_the_text_the_rewards_read(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A tokenizer without ``<|im_end|>`` as a special token (its ChatML template spells it in
    several tokens): no id can stop decoding there, so the completions are cut at the text, the
    rewards read the answer alone (before: "Seven<|im_end|>\\n<|im_..."), and the launch says so."""
    from hf_checkpoints import write_tokenizer

    write_tokenizer(tmp_path)
    texts = tmp_path / "texts.json"
    overrides = [
        *(o for o in GRPO_TINY if "seq_len" not in o), "model.max_seq_len=160", "data.seq_len=128",
        f"data.tokenizer={tmp_path / 'tokenizer.json'}", "objective.max_new_tokens=40",
        f"+objective.engine={{_target_: test_turn_end.SaysSeven, tokenizer: {tmp_path / 'tokenizer.json'}}}",
        f"+data.rewards.seen={{fn: {{_target_: test_turn_end.record_completions, _partial_: true, path: {texts}}}, weight: 0.0}}",
    ]  # fmt: skip
    cfg = compose_config(overrides, recipe="grpo", tiny=False)
    data = build_data(cfg)
    assert data.stop_ids() == () and data.stop_texts() == ("<|im_end|>",)
    assert "end of turn '<|im_end|>' is not one special token" in capsys.readouterr().err
    assert data.evaluators()[0].stop[-1] == "<|im_end|>"
    assert _supervised_end(data, data.tokenizer).endswith("<|im_end|>\n")
    fit(cfg, tmp_path)
    seen = json.loads(texts.read_text())  # the rollout's, and the held-out greedy answers of the model
    assert seen.count("Seven") == 16 and not any("<|im_end|>" in text for text in seen), seen


def test_an_export_stops_generate_at_the_templates_end_of_turn(tok: Tokenizer, tmp_path: Path) -> None:
    """A plait model trained with a ChatML tokenizer, exported: transformers' generate stops at
    <|im_end|> too (config.json's eos_token_id lists it; it named the EOS alone)."""
    transformers = pytest.importorskip("transformers")
    from trainer.export import write_hf_dir
    from trainer.models.llama import Llama

    model = Llama(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=64)
    out = write_hf_dir(
        tmp_path / "hf", model=model, state=model.state_dict(), tokenizer=tok, sources=[], chat_template=CHATML
    )
    (im_end,) = tok.encode("<|im_end|>")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [tok.eos_id, im_end]
    config = transformers.AutoConfig.from_pretrained(out)  # what generate() stops at, without a generation_config.json
    assert transformers.GenerationConfig.from_model_config(config).eos_token_id == [tok.eos_id, im_end]
    default = write_hf_dir(tmp_path / "default", model=model, state=model.state_dict(), tokenizer=tok, sources=[])
    assert json.loads((default / "config.json").read_text())["eos_token_id"] == tok.eos_id


def test_lm_eval_generations_stop_at_the_end_of_turn(tok: Tokenizer) -> None:
    """plait eval apply_chat_template=true: lm-eval's generate_until ran past <|im_end|> and, decoding
    without special tokens, glued the next turn onto the answer ('Sevenuserer...')."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from trainer.evaluators.plait_lm import PlaitLM

    template = JinjaTemplate(QWEN3_STYLE, eos_token=tok.eos_token)
    text = template.render([{"role": "user", "content": "Name a prime."}], add_generation_prompt=True)
    model = _answering_model(tok, tok.encode(text)[-1])
    lm = PlaitLM(model, tok, max_length=64, stop_ids=turn_end_ids(tok, template), kv_cache=False)
    assert lm.generate_until([Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 12}), 0)]) == [
        "Seven"
    ]


def test_chat_with_a_system_turn_the_template_refuses_exits_2_naming_it(tok: Tokenizer, monkeypatch, capsys) -> None:  # noqa: ANN001
    """plait chat system=... on a template without a system turn: a traceback (exit 1) before."""
    import io
    import sys

    from trainer import chat

    no_system = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + CHATML
    )
    monkeypatch.setattr(chat, "load_for_generation", lambda ckpt, trust: SimpleNamespace(model=None, tokenizer=tok))
    monkeypatch.setattr(chat, "chat_template", lambda run: JinjaTemplate(no_system, origin="strict.jinja"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\n")))
    with pytest.raises(SystemExit) as exit_:
        chat.main(["ckpt=unused", "system=Be brief."])
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and "strict.jinja refused a conversation with roles ['system', 'user']: System role" in err
    )


def test_chat_with_logits_that_overflow_exits_2_naming_the_fix(tok: Tokenizer, monkeypatch, capsys) -> None:  # noqa: ANN001
    """plait chat temperature=1e-40: one error line and exit 2, as plait generate (a traceback, exit 1,
    before: a reviewer's). Mutation: chat.main without its except -> the NonFiniteLogitsError escapes."""
    import io
    import sys

    from trainer import chat
    from trainer.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    run = SimpleNamespace(model=model.eval(), tokenizer=tok, checkpoint="runs/x/checkpoints/last")
    monkeypatch.setattr(chat, "load_for_generation", lambda ckpt, trust: run)
    monkeypatch.setattr(chat, "chat_template", lambda run: JinjaTemplate(CHATML, origin="chatml.jinja"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\n")))
    with pytest.raises(SystemExit) as exit_:
        chat.main(["ckpt=unused", "temperature=1e-40", "max_new_tokens=3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "plait: error: runs/x/checkpoints/last: temperature=1e-40" in err, err
