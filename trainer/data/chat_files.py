"""Where a Hugging Face tokenizer directory keeps its chat template: read as transformers reads it,
written where transformers 5 writes it.

transformers' tokenizer loading (``PreTrainedTokenizerBase.from_pretrained``, transformers 5)
takes the template from, in order:

1. ``chat_template.jinja`` (the default template) and ``additional_chat_templates/<name>.jinja``
   (named ones): when any of these files exists, they replace whatever
   ``tokenizer_config.json`` holds;
2. the ``chat_template`` entry of ``tokenizer_config.json``: the template text, or a list of
   ``{"name", "template"}`` (transformers 4 wrote it there).

Of named templates the one named ``default`` is rendered (transformers takes ``tool_use`` only
when tools are passed, and plait passes none); named templates without a default are refused
there and here. A processor (multimodal models) also reads the older ``chat_template.json``
(``{"chat_template": ...}``); plait reads it last, for a directory that has no other template.
transformers 5's ``save_pretrained`` writes ``chat_template.jinja`` and leaves the template out
of ``tokenizer_config.json``; `write_chat_template` does the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
PLACES = f"{TEMPLATE_FILE}, {NAMED_TEMPLATES_DIR}/, the chat_template of {TOKENIZER_CONFIG}, {PROCESSOR_TEMPLATE_FILE}"


class TemplateFileError(ValueError):
    """A directory's chat template files that transformers would refuse too; the message names the files."""


@dataclass(frozen=True)
class FoundTemplate:
    """A chat template's text and where it was read (a file, with the entry for a json file)."""

    source: str
    origin: str


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``directory`` ({} without one)."""
    path = directory / TOKENIZER_CONFIG
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _default(named: dict[str, str], origin: str) -> FoundTemplate:
    if "default" not in named:
        raise TemplateFileError(
            f"{origin} holds chat templates named {sorted(named)} but none named 'default', so transformers "
            f"renders none of them; add {TEMPLATE_FILE} (the default template) or use data.template=default"
        )
    return FoundTemplate(named["default"], origin)


def find_chat_template(directory: str | Path) -> FoundTemplate | None:
    """The chat template of a tokenizer directory, taken as transformers takes it (module docstring).

    Args:
        directory: the folder of a ``tokenizer.json``.

    Returns:
        The default template and its file, or None when the directory has no template.

    Raises:
        TemplateFileError: named templates without a default one.
    """
    directory = Path(directory).expanduser()
    named = {p.stem: p.read_text(encoding="utf-8") for p in sorted((directory / NAMED_TEMPLATES_DIR).glob("*.jinja"))}
    if (directory / TEMPLATE_FILE).is_file():
        return FoundTemplate((directory / TEMPLATE_FILE).read_text(encoding="utf-8"), str(directory / TEMPLATE_FILE))
    if named:
        return _default(named, str(directory / NAMED_TEMPLATES_DIR))
    entry = read_tokenizer_config(directory).get("chat_template")
    origin = f"{directory / TOKENIZER_CONFIG} (chat_template)"
    if isinstance(entry, list):  # [{"name": "default", "template": ...}, ...]
        return _default({t["name"]: t["template"] for t in entry}, origin)
    if isinstance(entry, str) and entry:
        return FoundTemplate(entry, origin)
    processor = directory / PROCESSOR_TEMPLATE_FILE
    if processor.is_file():
        entry = json.loads(processor.read_text(encoding="utf-8")).get("chat_template")
        return FoundTemplate(entry, f"{processor} (chat_template)") if isinstance(entry, str) and entry else None
    return None


def write_chat_template(directory: str | Path, source: str) -> Path:
    """Writes ``source`` as ``directory/chat_template.jinja`` and takes the ``chat_template`` entry
    out of its ``tokenizer_config.json`` (as transformers 5's ``save_pretrained`` does), so that
    the directory holds one template. Returns the file written."""
    directory = Path(directory)
    config = read_tokenizer_config(directory)
    if config.pop("chat_template", None) is not None:
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (directory / TEMPLATE_FILE).write_text(source, encoding="utf-8")
    return directory / TEMPLATE_FILE
