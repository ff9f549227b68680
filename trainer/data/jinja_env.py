"""The Jinja environment Hugging Face chat templates are written for, and their ``{% generation %}`` tag.

A chat template renders the same text here as in transformers' ``apply_chat_template``
(transformers ``utils/chat_template_utils.py``, the reference this follows): a sandbox whose
objects cannot be changed, ``trim_blocks`` and ``lstrip_blocks``, the loop controls
(``{% break %}``, ``{% continue %}``), ``raise_exception(message)``, and a ``tojson`` filter that
keeps non-ASCII characters, ``<``, ``>``, ``&`` and the keys' order as they are (Jinja's own
escapes them for HTML and sorts the keys).

``{% generation %}...{% endgeneration %}`` marks the text a model is trained to produce (TRL's
training templates; transformers' ``return_assistant_tokens_mask``). It renders its body
unchanged, or, in a template compiled with ``marks``, between the two mark strings, so that the
caller can find where each block's text lies in the rendering (trainer.data.chat).
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationBlock(Extension):
    """The ``{% generation %}`` block tag: its body, between the environment's ``generation_marks``."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        environment.extend(generation_marks=("", ""))

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_block"), [], [], body).set_lineno(lineno)

    def _render_block(self, caller: Any) -> str:
        start, end = self.environment.generation_marks  # type: ignore[attr-defined]
        return f"{start}{caller()}{end}"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str, *, marks: tuple[str, str] = ("", "")) -> tuple[jinja2.Template, bool]:
    """The compiled template and whether it has ``{% generation %}`` blocks.

    Args:
        source: the template text.
        marks: the strings written before and after each generation block's text.

    Raises:
        ValueError: ``source`` is not valid Jinja (the message gives the line).
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.generation_marks = marks  # type: ignore[attr-defined]
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        tree = env.parse(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ValueError(f"not a valid Jinja template (line {err.lineno}: {err.message})") from None
    has_generation = any(
        isinstance(block.call.node, nodes.ExtensionAttribute)
        and block.call.node.identifier == GenerationBlock.identifier
        for block in tree.find_all(nodes.CallBlock)
        if isinstance(block.call, nodes.Call)
    )
    return env.from_string(tree), has_generation
