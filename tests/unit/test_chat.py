"""Chat formatting: loss only on assistant tokens, multi-turn, the tokenizer's own Jinja template."""

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from trainer.data.chat import load_chat_template
from trainer.data.encode import conversations as encode_conversations
from trainer.data.packing import IGNORE_INDEX
from trainer.data.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "tool", "content": "calc: 4"},
    {"role": "assistant", "content": "4"},
]


def byte_tokenizer() -> Tokenizer:
    """Every byte is a token (ids 0-255 after the 2 special tokens)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1} | {ch: i + 2 for i, ch in enumerate(sorted(alphabet))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>"])
    return Tokenizer(tok)


def _targets(tok, ids, labels):
    """The supervised text, one run of consecutive targets per entry."""
    runs, current = [], []
    for t, label in enumerate(labels):
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


def test_default_template_supervises_every_assistant_turn_and_its_eos():
    tok = byte_tokenizer()
    ((ids, labels),) = encode_conversations(tok, [CONVERSATION])
    assert len(ids) == len(labels) and labels[-1] == IGNORE_INDEX
    assert _targets(tok, ids, labels) == ["Hello!<|endoftext|>", "4<|endoftext|>"]
    assert tok.decode(ids).startswith("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!")
    # Batched encoding gives the same ids and labels.
    assert encode_conversations(tok, [CONVERSATION, CONVERSATION[:3]])[0] == (ids, labels)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tokenizer_chat_template_spans_are_supervised(tmp_path):
    tok = byte_tokenizer()
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    template = load_chat_template(str(tmp_path / "tokenizer.json"), tok)
    assert template is not None
    ((ids, labels),) = encode_conversations(tok, [CONVERSATION], template)
    assert _targets(tok, ids, labels) == ["Hello!<|im_end|>\n", "4<|im_end|>\n"]
    assert tok.decode(ids) == template.render(CONVERSATION)


def test_no_tokenizer_config_means_the_default_template(tmp_path):
    tok = byte_tokenizer()
    tok.save(tmp_path / "tokenizer.json")
    assert load_chat_template(str(tmp_path / "tokenizer.json"), tok) is None


MISTRAL_STYLE = (  # Mistral v0.1's rule: roles alternate, starting with the user; no system turn
    "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
QWEN25_STYLE = (  # reads messages[0] to decide on a default system turn
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_refuses_a_conversation_is_a_chat_error_naming_its_roles(tmp_path):
    """A template's raise_exception, or an undefined messages[0] before an assistant-first turn,
    ended the run with a jinja2 traceback that named no row and no fix (a reviewer's Mistral-style
    template on rows with a system turn; string_rows: chat text rows under a Qwen2.5-style one)."""
    import pytest

    from trainer.data.chat import ChatError, JinjaTemplate

    tok = byte_tokenizer()
    mistral = JinjaTemplate(MISTRAL_STYLE, origin="mistral.jinja", bos_token="", eos_token="<|endoftext|>")
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    with pytest.raises(
        ChatError,
        match=r"mistral.jinja refused a conversation with roles \['system', 'user', 'assistant'\]: Conversation roles must alternate.*data.template=default",
    ):
        encode_conversations(tok, [chat], mistral)
    assert encode_conversations(tok, [chat[1:]], mistral)  # the same rows without the system turn train
    qwen = JinjaTemplate(QWEN25_STYLE, origin="qwen.jinja")
    with pytest.raises(
        ChatError,
        match=r"qwen.jinja cannot render the turns before assistant turn 0 of a conversation with roles \['assistant'\].*start conversations with a user turn",
    ):
        encode_conversations(tok, [[{"role": "assistant", "content": "A text row."}]], qwen)
