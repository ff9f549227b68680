"""Chat templates with ``{% generation %}`` blocks: plait supervises exactly the tokens transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks, with the same input ids.

The reference is transformers itself, on a real ``tokenizers`` BPE and two training templates in
the styles of TRL's (tests/chat_templates.py).
"""

from __future__ import annotations

import pytest
from chat_templates import CONVERSATIONS, LLAMA3_STYLE, QWEN3_STYLE, raw_tokenizer
from tokenizers import Tokenizer as HFTokenizer

from trainer.data import encode
from trainer.data.chat import ChatError, JinjaTemplate
from trainer.data.packing import IGNORE_INDEX
from trainer.data.tokenizer import Tokenizer

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) is the reference for chat templates"
)


@pytest.fixture(scope="module")
def tokenizers_pair() -> tuple[Tokenizer, object]:
    """plait's tokenizer and transformers' fast tokenizer over the same ``tokenizers`` object."""
    raw = raw_tokenizer()
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|endoftext|>", bos_token="<|begin_of_text|>"
    )
    return Tokenizer(HFTokenizer.from_str(raw.to_str())), hf


def _reference(hf, source: str, messages) -> tuple[list[int], list[int]]:
    """transformers' ids and pre-shifted labels (written here): label t is id t+1 where token t+1 is masked in."""
    out = hf.apply_chat_template(
        messages, chat_template=source, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    return ids, [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


@pytest.mark.parametrize("source", [QWEN3_STYLE, LLAMA3_STYLE], ids=["qwen3_style", "llama3_style"])
def test_generation_blocks_supervise_what_transformers_masks(tokenizers_pair, source) -> None:
    tok, hf = tokenizers_pair
    template = JinjaTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
    assert template.has_generation
    got = encode.conversations(tok, CONVERSATIONS, template)
    for messages, (ids, labels) in zip(CONVERSATIONS, got):
        expected_ids, expected_labels = _reference(hf, source, messages)
        assert ids == expected_ids
        assert labels == expected_labels
        supervised = [t for t in labels if t != IGNORE_INDEX]
        assert len(supervised) > 3 * sum(m["role"] == "assistant" for m in messages)  # every answer is in


def test_the_qwen3_style_template_is_not_prefix_consistent(tokenizers_pair) -> None:
    """Without its generation blocks the same template cannot be used: assistant turns are located
    by prefix rendering, which reasoning dropped from earlier turns breaks."""
    tok, _ = tokenizers_pair
    plain = JinjaTemplate(QWEN3_STYLE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    assert not plain.has_generation
    with pytest.raises(ChatError, match="prefix"):
        encode.conversations(tok, [CONVERSATIONS[1]], plain)


def test_a_preference_pair_takes_the_final_generation_block_as_its_response(tokenizers_pair) -> None:
    tok, hf = tokenizers_pair
    template = JinjaTemplate(QWEN3_STYLE)
    record = {"messages": CONVERSATIONS[1][:-1], "chosen": "<think>\nSure.\n</think>\n\nIt is 4.", "rejected": "Five."}
    prompt, chosen, rejected = encode.pair(tok, record, template)
    for answer, response in ((record["chosen"], chosen), (record["rejected"], rejected)):
        out = hf.apply_chat_template(
            [*record["messages"], {"role": "assistant", "content": answer}],
            chat_template=QWEN3_STYLE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        start = max(t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1]))  # the last masked run
        end = start + next((k for k, m in enumerate(mask[start:]) if not m), len(mask) - start)
        assert prompt == ids[:start]
        assert response == ids[start:end]
    assert tok.decode(chosen).startswith("<|im_start|>assistant\n<think>\nSure.")


def test_blocks_that_render_nothing_are_refused(tokenizers_pair) -> None:
    tok, _ = tokenizers_pair
    source = "{% for m in messages %}{{ m.content }}{% generation %}{% if m.role == 'tool' %}x{% endif %}{% endgeneration %}{% endfor %}"
    with pytest.raises(ChatError, match="render no text .* 1 assistant message"):
        encode.conversations(tok, [CONVERSATIONS[0]], JinjaTemplate(source))


def test_renders_as_transformers_does(tokenizers_pair) -> None:
    """tojson keeps non-ASCII, '<' and the keys' order (Jinja's own escapes and sorts), and
    ``{% break %}`` works, as in transformers."""
    _, hf = tokenizers_pair
    source = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}\n{% endfor %}"
    messages = [
        {"role": "user", "content": "<b>café</b> & co"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "x"},
    ]
    assert JinjaTemplate(source).render(messages) == hf.apply_chat_template(
        messages, chat_template=source, tokenize=False
    )


def test_a_template_that_is_not_jinja_names_its_origin() -> None:
    with pytest.raises(ChatError, match=r"my/chat_template.jinja: not a valid Jinja template \(line 1"):
        JinjaTemplate("{% for m in messages %}{{ m.content }}", origin="my/chat_template.jinja")


def test_a_pair_whose_last_block_is_not_the_final_turn_is_refused(tokenizers_pair) -> None:
    """A template that marks only the first answer would make an earlier turn the pair's response."""
    from trainer.data.base import DataError

    tok, _ = tokenizers_pair
    source = (
        "{% for m in messages %}{% if m.role == 'assistant' and loop.index0 == 1 %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    record = {"messages": CONVERSATIONS[2][1:4], "chosen": "Salut !", "rejected": "Hola !"}
    with pytest.raises(DataError, match="not the final assistant turn"):
        encode.pair(tok, record, JinjaTemplate(source))
