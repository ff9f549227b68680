"""Chat formatting for SFT: conversations -> ``(text, supervised)`` segments (encoded by trainer.data.encode).

A conversation is a list of ``{"role": ..., "content": ...}`` messages; roles are ``system``,
``user``, ``assistant`` and ``tool`` (a tool's output). A row of TRL's standard format (`Text`:
string ``prompt`` and ``completion``, or ``text``) is no conversation: its segments are the prompt
then the completion, as they are (`text_segments`), and no template renders it.

Two templates:

- the **default** template, role markers in plain text, every assistant turn ended by the
  tokenizer's EOS (so generation knows when to stop)::

      <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<EOS>\\n<|user|>...

  supervised: ``{content}<EOS>`` of each assistant turn (multi-turn: all of them);
- the **tokenizer's own** template: a Hugging Face Jinja ``chat_template`` (found beside the
  ``tokenizer.json`` by trainer.data.chat_files), rendered with jinja2 (which torch already
  depends on) in an environment like transformers' ``apply_chat_template``. Its supervised text:

  * with ``{% generation %}...{% endgeneration %}`` blocks (TRL's training templates and many hub
    templates), exactly the text those blocks render, as transformers'
    ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks it;
  * without them, each assistant turn: what rendering ``messages[:i+1]`` adds to rendering
    ``messages[:i]`` with the generation prompt (so the turn's end-of-turn marker is trained too).

The text is cut into segments at the supervised spans and each segment is tokenized on its own,
so the supervision mask is built on the input ids themselves and never by searching labels for a
template (case C22: searching the labels fails when the template contains the pad token). Where a
tokenizer would merge text across a span's edge, the cut keeps the two sides apart, as at
inference, where the prompt is tokenized alone (transformers' mask instead marks the straddling
token); with pre-tokenizers that split at special tokens and newlines (Llama 3, Qwen) both give
the same ids and mask. `completion_mask` does the search for a response template given as ids,
on the input ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import jinja2

from trainer.data.chat_files import TemplateFileError, find_chat_template, read_tokenizer_config
from trainer.data.jinja_env import compile_template
from trainer.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
MARKERS = {role: f"<|{role}|>\n" for role in ROLES}
# An answer no template alters (`JinjaTemplate.turn_end` finds what follows it).
_PROBE_ANSWER = "Answer."

Message = dict[str, str]


class Text(TypedDict):
    """An SFT row of TRL's standard format (strings): ``prompt`` (context; empty for a ``text``
    row) then ``completion`` (supervised), joined as they are: no chat template renders it."""

    prompt: str
    completion: str


Record = list[Message] | Text  # one SFT record: a conversation (chat template) or standard text

# The default template as a Hugging Face ``chat_template`` (what `plait export` writes, and what
# `plait chat` renders): the same text as `default_segments` / `prompt_text`, EOS after each
# assistant turn. No newline follows a block tag (transformers renders with trim_blocks).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
DEFAULT_DESCRIPTION = "plait's default (<|user|> / <|assistant|> lines, EOS after each answer)"


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


def text_segments(record: Text) -> list[tuple[str, bool]]:
    """A standard row as ``(text, supervised)`` segments: the prompt (if any), then the completion."""
    return ([(record["prompt"], False)] if record["prompt"] else []) + [(record["completion"], True)]


def as_conversation(record: Record) -> list[Message]:
    """A standard row as a user turn (its prompt, if any) and an assistant turn; a conversation as it is."""
    if not isinstance(record, dict):
        return list(record)
    user = [{"role": "user", "content": record["prompt"]}] if record["prompt"] else []
    return [*user, {"role": "assistant", "content": record["completion"]}]


def prompt_text(messages: Sequence[Message]) -> str:
    """The default template's text of ``messages`` followed by the assistant marker (a generation
    prompt; the model continues with the answer and EOS)."""
    return "".join(MARKERS[m["role"]] + m["content"] + "\n" for m in messages) + MARKERS["assistant"]


# Marks around the text of each {% generation %} block while spans are located: Unicode
# noncharacters, reserved for a program's internal use and never part of interchanged text.
SPAN_START, SPAN_END = "\ufdd0", "\ufdd1"


class JinjaTemplate:
    """A Hugging Face ``chat_template`` (Jinja), rendered as transformers' ``apply_chat_template`` does.

    The environment is transformers': sandboxed, ``trim_blocks`` and ``lstrip_blocks``, the
    ``{% generation %}`` tag (trainer.data.jinja_env), loop controls (``{% break %}``,
    ``{% continue %}``), ``raise_exception`` and a ``tojson`` that neither escapes HTML nor
    sorts keys; ``tools`` and ``documents`` are None. ``strftime_now`` is left undefined, so a
    template's date falls back to its own default: the same data renders the same on any day.

    Args:
        source: the template text.
        origin: where it came from (a file, for the launch line and errors).
        special: the special tokens the template reads (``bos_token``, ``eos_token``, ...).

    Raises:
        ChatError: the template is not valid Jinja.
    """

    def __init__(self, source: str, *, origin: str = "a chat_template", **special: str) -> None:
        self.source, self.origin, self.special = source, origin, special
        try:
            self._template, self.has_generation = compile_template(source)
            self._marked, _ = compile_template(source, marks=(SPAN_START, SPAN_END))
        except ValueError as err:
            raise ChatError(f"{origin}: {err}") from None

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        return self._render(self._template, messages, add_generation_prompt)

    def _render(self, template: Any, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The rendering of ``messages``.

        Raises:
            ChatError: the template raised on them (its ``raise_exception``, or an undefined
                value such as ``messages[0]`` of none), naming their roles.
        """
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special,
            )
        except jinja2.TemplateError as err:
            roles = [m.get("role") for m in messages]
            raise ChatError(
                f"{self.origin} refused a conversation with roles {roles}: {err}; give it turns of the form it "
                "takes (many templates take alternating user/assistant turns, some no system turn): fix or drop "
                "such rows, or a chat's system=, or train with plait's default template (data.template=default)"
            ) from None

    def segments(self, messages: Sequence[Message]) -> list[tuple[str, bool]]:
        """``(text, supervised)`` segments: the ``{% generation %}`` spans when the template has
        them, else each assistant turn's span found by prefix rendering.

        Raises:
            ChatError: a malformed conversation; generation blocks that render no text for it;
                or, without generation blocks, a template that does not render conversations
                prefix-consistently.
        """
        check_messages(messages)
        spans = self.generation_spans(messages) if self.has_generation else self._turn_spans(messages)
        full = self.render(messages)
        segments: list[tuple[str, bool]] = []
        done = 0  # characters of the full rendering already in segments
        for start, end in spans:
            segments.append((full[done:start], False))
            segments.append((full[start:end], True))
            done = end
        segments.append((full[done:], False))
        return [(text, sup) for text, sup in segments if text]

    def generation_spans(self, messages: Sequence[Message]) -> list[tuple[int, int]]:
        """``[start, end)`` character spans of the text the ``{% generation %}`` blocks render in
        ``render(messages)``, in order; nested or touching blocks are one span.

        Raises:
            ChatError: no block renders any text for this conversation (it would train on nothing),
                or the marked rendering differs from the plain one (a filter applied over a block,
                or a message holding U+FDD0 / U+FDD1).
        """
        marked = self._render(self._marked, messages, False)
        spans: list[tuple[int, int]] = []
        text: list[str] = []
        length = depth = start = 0
        for piece in re.split(f"([{SPAN_START}{SPAN_END}])", marked):
            if piece == SPAN_START:
                depth += 1
                start = length if depth == 1 else start
            elif piece == SPAN_END:
                depth -= 1
                if depth < 0:
                    break
                if depth == 0 and length > start:
                    start = spans.pop()[0] if spans and spans[-1][1] == start else start
                    spans.append((start, length))
            else:
                text.append(piece)
                length += len(piece)
        if depth != 0 or "".join(text) != self.render(messages):
            raise ChatError(
                f"{self.origin}: the text of its {{% generation %}} blocks cannot be located in the rendering (a filter "
                "applied over a block, or a message holding U+FDD0/U+FDD1); use data.template=default"
            )
        if not spans:
            raise ChatError(
                f"{self.origin}: its {{% generation %}} blocks render no text for a conversation with "
                f"{sum(m['role'] == 'assistant' for m in messages)} assistant message(s), so it has no supervised token: "
                f"{[m['role'] for m in messages]}; fix the template or use data.template=default"
            )
        return spans

    def turn_end(self) -> str:
        """The text the template writes after an assistant's content inside the span it supervises
        (ChatML's ``<|im_end|>\\n``, Llama 3's ``<|eot_id|>``): what a model trained on its
        renderings learns to emit when its answer is done. Found by rendering a one-question
        conversation (with a system turn too, for templates that require one). Empty where the
        template writes nothing there, alters the answer's text, or renders neither probe."""
        question = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": _PROBE_ANSWER}]
        for probe in (question, [{"role": "system", "content": "Answer."}, *question]):
            try:
                supervised = "".join(text for text, sup in self.segments(probe) if sup)
            except ChatError:
                continue
            before, found, after = supervised.rpartition(_PROBE_ANSWER)
            if found:
                return after
        return ""

    def _turn_spans(self, messages: Sequence[Message]) -> list[tuple[int, int]]:
        """Each assistant turn's span by prefix rendering (templates without generation blocks)."""
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                before = self.render(messages[:i], add_generation_prompt=True)
            except ChatError:
                raise ChatError(
                    f"{self.origin} cannot render the turns before assistant turn {i} of a conversation with roles "
                    f"{[m['role'] for m in messages]} (it locates each assistant turn by rendering what precedes it); "
                    "start conversations with a user turn, or use data.template=default"
                ) from None
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise ChatError(
                    "the tokenizer's chat_template does not render a conversation as a prefix of its longer "
                    "versions, so assistant turns cannot be located; use data.template=default"
                )
            spans.append((len(before), len(through)))
        return spans


# Template variables holding special tokens: transformers passes the tokenizer's, plait those of
# the tokenizer_config.json beside the template (the tokenizer's EOS when it names none).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_chat_template(tokenizer_path: str | None, tokenizer: Tokenizer) -> JinjaTemplate | None:
    """The chat template beside ``tokenizer_path``, wherever transformers would read it
    (trainer.data.chat_files: ``chat_template.jinja`` first, then ``tokenizer_config.json``), with
    the special tokens of that ``tokenizer_config.json``; None without one.

    Raises:
        ChatError: named templates without a default, or a template that is not valid Jinja.
    """
    if tokenizer_path is None:
        return None
    directory = Path(tokenizer_path).expanduser().parent
    try:
        found = find_chat_template(directory)
    except TemplateFileError as err:
        raise ChatError(str(err)) from None
    if found is None:
        return None
    config = read_tokenizer_config(directory)
    special = {"bos_token": "", "eos_token": tokenizer.eos_token}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if value:
            special[key] = value["content"] if isinstance(value, dict) else value
    return JinjaTemplate(found.source, origin=found.origin, **special)


@dataclass(frozen=True)
class ChatFormat:
    """The chat template a data module renders with, for the launch line and the run's record.

    Args:
        template: the tokenizer's own template, or None for plait's default.
        reason: why the default (``data.template=default``, or where no template was found);
            empty for a tokenizer's template.
    """

    template: JinjaTemplate | None
    reason: str = ""

    @property
    def source(self) -> str:
        """The Jinja text of the template trained with (`DEFAULT_CHAT_TEMPLATE` for the default)."""
        return DEFAULT_CHAT_TEMPLATE if self.template is None else self.template.source

    def line(self) -> str:
        """``chat template: <file> (what is supervised)``, or the default and why."""
        if self.template is None:
            return f"chat template: {DEFAULT_DESCRIPTION} ({self.reason})"
        supervised = "its {% generation %} blocks" if self.template.has_generation else "each assistant turn"
        return f"chat template: {self.template.origin} (supervised: {supervised})"


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
