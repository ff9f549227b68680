"""Realistic chat templates and a tokenizer for them, shared by the chat template tests.

A byte-level BPE trained here (nothing downloads) with Qwen2's / Llama 3's pre-tokenizer split and
the ChatML and Llama 3 special tokens, and two training templates written for these tests in the
styles of TRL's: a Qwen3-like one with reasoning blocks, whose whole assistant turn is the
``{% generation %}`` block, and a Llama 3-like one whose block is the answer and its end marker.
"""

from __future__ import annotations

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# Qwen2's and Llama 3's pre-tokenizer split (letters, digits, punctuation runs, newline runs).
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# ChatML with a reasoning block. Reasoning is kept only for the answers after the last user
# question (as Qwen3 does), so the rendering of a conversation is not a prefix of its longer
# versions: only generation blocks can locate its assistant turns.
QWEN3_STYLE = """\
{#- Training template: each assistant turn, header to end marker, is one generation block. -#}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_question=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_question = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set answer = message.content %}
        {%- set thought = '' %}
        {%- if '<think>' in answer and '</think>' in answer %}
            {%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {% generation %}
        {%- if loop.index0 > ns.last_question %}
            {{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}
        {%- endif %}
        {% endgeneration %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

# Llama 3 headers; the block is the answer and its end marker; empty system messages are skipped
# with a loop control.
LLAMA3_STYLE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'system' and message.content == '' %}{% continue %}{% endif %}
    {{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\\n\\n' }}
    {%- if message.role == 'assistant' %}
        {%- generation -%}
            {{ message.content | trim }}<|eot_id|>
        {%- endgeneration -%}
    {%- else %}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven is prime."}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\nFour."},
        {"role": "user", "content": "Check it with the calculator."},
        {"role": "assistant", "content": "Calling the calculator."},
        {"role": "tool", "content": "4"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "<think>\nThe tool agrees.\n</think>\n\nIt is 4, confirmed."},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Say hello twice."},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Again, in French."},
        {"role": "assistant", "content": "Bonjour ! Bonjour !"},
    ],
]


def raw_tokenizer() -> HFTokenizer:
    """A byte-level BPE with a Qwen-style split, trained on a few lines that use the templates' markers."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for conv in CONVERSATIONS for m in conv] * 4 + [
        "assistant\n<think>\n\n</think>\n\n user system\n\n"
    ] * 8
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(["<think>", "</think>"])
    return tok
