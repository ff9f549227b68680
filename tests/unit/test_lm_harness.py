"""plait's lm-eval adapter (`trainer.evaluators.plait_lm.PlaitLM`) against lm-eval's own
Hugging Face model class (``HFLM``) on the same transformers checkpoint: the reference is lm-eval's
code path through transformers' model, not plait's."""

from __future__ import annotations

import random

import numpy
import pytest
import tokenizers
import torch
from hf_checkpoints import corpus_texts, make_hf_dir
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from tokenizers.processors import TemplateProcessing

from trainer.data.chat import DEFAULT_CHAT_TEMPLATE, JinjaTemplate
from trainer.data.tokenizer import train_bpe
from trainer.evaluators.lm_harness import evaluate_tasks, task_manager
from trainer.evaluators.plait_lm import PlaitLM
from trainer.evaluators.tasks.bundled import held_out, next_line_choices
from trainer.export import write_hf_dir
from trainer.models.llama import Llama
from trainer.run_model import load_run_model

LONG = "the quick brown fox jumps over the lazy dog " * 12  # longer than the checkpoint's 128 tokens


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hub") / "llama"
    make_hf_dir("llama3", directory)
    run = load_run_model(directory)
    return PlaitLM(run.model, run.tokenizer, batch_size=3), HFLM(
        pretrained=str(directory), device="cpu", dtype="float32", batch_size=3
    )


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihoods_equal_lm_evals_hf_model(both) -> None:
    """Contexts empty, short, and longer than the context (cut from the left), batched with
    different lengths: the same log-probabilities and greedy flags."""
    plait, hf = both
    assert plait.max_length == hf.max_length == 128 and plait.prefix_token_id == hf.prefix_token_id
    greedy = plait.generate_until(_requests("generate_until", [("a b c", {"until": [], "max_gen_toks": 3})]))[0]
    pairs = [("hello", " world"), ("", "abc def"), (LONG, " jumps"), ("a b c", " d e f g"), ("a b c", greedy)]
    ours, theirs = (
        plait.loglikelihood(_requests("loglikelihood", pairs)),
        hf.loglikelihood(_requests("loglikelihood", pairs)),
    )
    torch.testing.assert_close([s for s, _ in ours], [s for s, _ in theirs], rtol=0, atol=1e-4)
    assert [g for _, g in ours] == [g for _, g in theirs] == [False, False, False, False, True]


def test_rolling_loglikelihoods_equal_lm_evals_hf_model(both) -> None:
    """A text of one window and one of several (each window after as much text as fits)."""
    plait, hf = both
    texts = [("hello world",), (LONG * 2,)]
    ours = plait.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    theirs = hf.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_greedy_generation_equals_lm_evals_hf_model(both) -> None:
    """Greedy continuations with the KV cache, cut before the first stop string."""
    plait, hf = both
    args = [("hello", {"until": ["zz"], "max_gen_toks": 12}), ("the quick brown", {"until": ["X"], "max_gen_toks": 9})]
    ours = plait.generate_until(_requests("generate_until", args))
    theirs = hf.generate_until(_requests("generate_until", args))
    assert ours == theirs
    uncut = plait.generate_until(_requests("generate_until", [(c, {"until": [], "max_gen_toks": 12}) for c, _ in args]))
    stop = uncut[0][3:5]  # a stop string the first continuation does hold: the text ends before it
    cut = plait.generate_until(_requests("generate_until", [("hello", {"until": [stop], "max_gen_toks": 12})]))
    assert cut == [uncut[0][: uncut[0].find(stop)]]


def test_bundled_next_line_task_points_at_the_true_next_line() -> None:
    """Each row's right choice is the line after its context in a held-out document; the three
    others come from other held-out documents of the same source."""
    rows = next_line_choices()["test"]
    docs = held_out()
    assert len(docs) == 37 and len(rows) == 148
    lines = ["\n".join(line for line in d.text.splitlines() if line.strip()) for d in docs]  # blank lines left out
    for row in list(rows)[::10]:
        source_text = "\n".join(d.text for d in docs if d.source == row["source"])
        own = [d for d, text in zip(docs, lines) if row["context"] + "\n" + row["choices"][row["label"]] in text]
        assert len(own) == 1 and own[0].source == row["source"]
        for k, choice in enumerate(row["choices"]):
            assert choice in source_text
            if k != row["label"]:
                assert choice not in own[0].text


def test_evaluation_leaves_the_global_generators_as_they_were(both) -> None:
    """lm-eval seeds Python's, NumPy's and torch's generators; a training run's next draws do not change."""
    plait, _ = both
    torch.manual_seed(123), random.seed(123), numpy.random.seed(123)
    expected = (torch.rand(3), random.random(), numpy.random.rand())
    torch.manual_seed(123), random.seed(123), numpy.random.seed(123)
    scores, _ = evaluate_tasks(plait, ["plait_corpus_next_line"], limit=2)
    assert set(scores) == {"plait_corpus_next_line/acc", "plait_corpus_next_line/acc_norm"}
    got = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_plaits_own_tasks_are_found_without_lm_evals_registry() -> None:
    """The bundled tasks index in a blink (lm-eval's 14,000 take seconds: the CLI test covers them)."""
    assert {"plait_bundled", "plait_corpus", "plait_corpus_next_line"} <= set(task_manager(["plait_bundled"]).all_tasks)


def test_plaits_exported_model_scores_as_lm_evals_hf_model_reads_it(tmp_path) -> None:
    """A model of plait's own (QK-norm, GQA, untied head), exported by `write_hf_dir` with its
    tokenizer and chat template: lm-eval's HFLM on the export gives the adapter's log-likelihoods,
    and the same chat prompt (the exported template against the run's own)."""
    torch.manual_seed(0)
    model = Llama(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=96, qk_norm=True
    ).eval()
    tokenizer = train_bpe(corpus_texts(), vocab_size=300)
    out = write_hf_dir(tmp_path / "hf", model=model, state=model.state_dict(), tokenizer=tokenizer, sources=[])
    template = JinjaTemplate(DEFAULT_CHAT_TEMPLATE, eos_token=tokenizer.eos_token)
    plait = PlaitLM(
        model, tokenizer, batch_size=2, chat_template=lambda m, g: template.render(m, add_generation_prompt=g)
    )
    hf = HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=2)
    pairs = [("thou art", " a king"), (LONG, " dog"), ("", "in the beginning")]
    torch.testing.assert_close(
        [s for s, _ in plait.loglikelihood(_requests("loglikelihood", pairs))],
        [s for s, _ in hf.loglikelihood(_requests("loglikelihood", pairs))],
        rtol=0,
        atol=1e-4,
    )
    messages = [{"role": "user", "content": "Who art thou?"}]
    assert plait.apply_chat_template(messages) == hf.apply_chat_template(messages)
    prefilled = [*messages, {"role": "assistant", "content": "I am"}]  # a task's gen_prefix: no end of turn after it
    assert plait.apply_chat_template(prefilled, False) == hf.apply_chat_template(prefilled, False)
    assert plait.apply_chat_template(prefilled, False).endswith("I am")


def test_a_tokenizer_that_prepends_bos_scores_as_lm_evals_hf_model(tmp_path) -> None:
    """A Llama-3-like checkpoint whose tokenizer's post-processor prepends BOS: HFLM adds it (the
    tokenizer's default) and conditions empty contexts and rolling windows on it; so does the adapter."""
    directory = tmp_path / "bos"
    make_hf_dir("llama3", directory)
    raw = tokenizers.Tokenizer.from_str(train_bpe(corpus_texts(), vocab_size=298).to_str())
    raw.add_special_tokens(["<|begin_of_text|>"])
    bos = raw.token_to_id("<|begin_of_text|>")
    raw.post_processor = TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    raw.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|begin_of_text|>"}'
    )
    run = load_run_model(directory)
    plait, hf = (
        PlaitLM(run.model, run.tokenizer, batch_size=2),
        HFLM(pretrained=str(directory), device="cpu", dtype="float32", batch_size=2),
    )
    assert plait.prefix_token_id == hf.prefix_token_id == bos
    assert plait.tok_encode("thou art") == hf.tok_encode("thou art") and plait.tok_encode("thou art")[0] == bos
    pairs = [("thou art more", " lovely"), ("", "thou art")]
    torch.testing.assert_close(
        [s for s, _ in plait.loglikelihood(_requests("loglikelihood", pairs))],
        [s for s, _ in hf.loglikelihood(_requests("loglikelihood", pairs))],
        rtol=0,
        atol=1e-4,
    )
    texts = [("thou art more lovely and more temperate",)]
    torch.testing.assert_close(
        plait.loglikelihood_rolling(_requests("loglikelihood_rolling", texts)),
        hf.loglikelihood_rolling(_requests("loglikelihood_rolling", texts)),
        rtol=0,
        atol=1e-4,
    )


def test_a_long_default_generation_keeps_the_prompt(both, caplog) -> None:
    """A task's default 256 new tokens on a 128-token model: the prompt stays whole and generation
    stops at the context's end (HFLM refuses max_gen_toks >= max_length); the greedy text begins
    with the short generation's. A prompt longer than half the context is cut, with a warning."""
    plait, _ = both
    prompt = "the quick brown fox jumps over"
    short = plait.generate_until(_requests("generate_until", [(prompt, {"until": [], "max_gen_toks": 6})]))[0]
    long = plait.generate_until(_requests("generate_until", [(prompt, {"until": []})]))[0]
    assert long.startswith(short) and len(long) > len(short)
    plait.generate_until(_requests("generate_until", [(LONG, {"until": [], "max_new_tokens": 4})]))
    assert "1 of 1 generation prompts were cut from the left" in caplog.text
