"""Chat formatting for SFT: conversations -> ``(text, supervised)`` segments (encoded by trainer.data.encode).

A conversation is a list of ``{"role": ..., "content": ...}`` messages; roles are ``system``,
``user``, ``assistant`` and ``tool`` (a tool's output). Every assistant message is supervised
(multi-turn: all of them), nothing else is.

Two templates:

- the **default** template, role markers in plain text, every assistant turn ended by the
  tokenizer's EOS (so generation knows when to stop)::

      <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<EOS>\\n<|user|>...

  supervised: ``{content}<EOS>`` of each assistant turn;
- the **tokenizer's own** template: the Jinja ``chat_template`` of a ``tokenizer_config.json``
  next to the ``tokenizer.json`` (rendered with jinja2, which torch already depends on). The
  supervised span of assistant turn i is what rendering ``messages[:i+1]`` adds to rendering
  ``messages[:i]`` with the generation prompt (so the turn's end-of-turn marker is trained too).

The text is cut into segments at the supervised spans and each segment is tokenized on its own,
so the supervision mask is built on the input ids themselves and never by searching labels for a
template (case C22: searching the labels fails when the template contains the pad token).
`completion_mask` does that search for a response template given as ids, on the input ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
MARKERS = {role: f"<|{role}|>\n" for role in ROLES}

Message = dict[str, str]

# The default template as a Hugging Face ``chat_template`` (what `plait export` writes, and what
# `plait chat` renders): the same text as `default_segments` / `prompt_text`, EOS after each
# assistant turn. No newline follows a block tag (transformers renders with trim_blocks).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class ChatError(ValueError):
    """A conversation or chat template that cannot be formatted; the message names the fix."""


def check_messages(messages: Sequence[Message]) -> None:
    """Raises ChatError for an unknown role, a non-string content or a conversation without an
    assistant message (it would have no supervised token)."""
    for m in messages:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatError(f"message {m!r}: needs role in {ROLES} and a string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError("a conversation without an assistant message has no supervised token")


def default_segments(messages: Sequence[Message]) -> list[tuple[str, bool]]:
    """The default template as ``(text, supervised)`` segments; an EOS follows each supervised one."""
    check_messages(messages)
    segments: list[tuple[str, bool]] = []
    for m in messages:
        if m["role"] == "assistant":
            segments.append((MARKERS["assistant"], False))
            segments.append((m["content"], True))
            segments.append(("\n", False))
        else:
            segments.append((MARKERS[m["role"]] + m["content"] + "\n", False))
    return segments


def prompt_text(messages: Sequence[Message]) -> str:
    """The default template's text of ``messages`` followed by the assistant marker (a generation
    prompt; the model continues with the answer and EOS)."""
    return "".join(MARKERS[m["role"]] + m["content"] + "\n" for m in messages) + MARKERS["assistant"]


class JinjaTemplate:
    """A Hugging Face ``chat_template`` (Jinja) rendered with jinja2.

    Args:
        source: the template text.
        special: extra variables the template reads (``bos_token``, ``eos_token``).

    Raises:
        ChatError: jinja2 is not installed.
    """

    def __init__(self, source: str, **special: str) -> None:
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - torch depends on jinja2
            raise ChatError("the tokenizer's chat_template needs jinja2: pip install jinja2") from None

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self.special = special

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special)

    def segments(self, messages: Sequence[Message]) -> list[tuple[str, bool]]:
        """``(text, supervised)`` segments: each assistant turn's span, found by prefix rendering.

        Raises:
            ChatError: the template does not render conversations prefix-consistently.
        """
        check_messages(messages)
        segments: list[tuple[str, bool]] = []
        done = 0  # characters of the full rendering already in segments
        full = self.render(messages)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise ChatError(
                    "the tokenizer's chat_template does not render a conversation as a prefix of its longer "
                    "versions, so assistant turns cannot be located; use data.template=default"
                )
            segments.append((full[done : len(before)], False))
            segments.append((full[len(before) : len(through)], True))
            done = len(through)
        segments.append((full[done:], False))
        return [(text, sup) for text, sup in segments if text]


def load_chat_template(tokenizer_path: str | None, tokenizer: Tokenizer) -> JinjaTemplate | None:
    """The ``chat_template`` of the ``tokenizer_config.json`` beside ``tokenizer_path`` (None if absent)."""
    if tokenizer_path is None:
        return None
    config_file = Path(tokenizer_path).expanduser().with_name("tokenizer_config.json")
    if not config_file.is_file():
        return None
    config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None

    def token(key: str, fallback: str) -> str:
        value = config.get(key) or fallback
        return value["content"] if isinstance(value, dict) else value

    return JinjaTemplate(source, bos_token=token("bos_token", ""), eos_token=token("eos_token", tokenizer.eos_token))


def completion_mask(input_ids: Sequence[int], response_template: Sequence[int]) -> list[bool]:
    """Supervised tokens after each occurrence of ``response_template``, matched on the input ids.

    Everything after the end of a template match up to the next match (or the end) is supervised,
    pad or EOS tokens included: the mask is found on ``input_ids``, never on labels that already
    mask pads (case C22).

    Raises:
        ChatError: the template does not occur (0 supervised tokens would be trained silently).
    """
    n, k = len(input_ids), len(response_template)
    starts = [i for i in range(n - k + 1) if list(input_ids[i : i + k]) == list(response_template)]
    if not starts or k == 0:
        raise ChatError(f"response template {list(response_template)} not found in input_ids; nothing to supervise")
    mask = [False] * n
    for j, s in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else n
        for t in range(s + k, end):
            mask[t] = True
    return mask
