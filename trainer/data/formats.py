"""The row formats users already have (TRL's dataset formats) -> plait's records.

Each reader takes one row (a dict, columns already mapped: `trainer.data.tables.rename`) and
returns plait's record, or raises `FormatError` with the fix; `read` adds the file and line.
TRL's formats (https://huggingface.co/docs/trl/dataset_formats), standard (strings) and
conversational (message lists ``[{"role", "content"}]``):

- SFT (`conversation`), TRL's rule: a conversational row (``messages``, or ``prompt`` +
  ``completion`` where either is a message list) goes through the chat template; a standard row
  (``prompt`` + ``completion`` strings, plait's ``prompt`` + ``response`` strings, or ``text``) is
  plain text, prompt then completion as they are, loss on the completion (`trainer.data.chat.Text`;
  ``data.sources.<name>.string_rows=chat`` renders it as a user and an assistant turn instead).
- preference (`pair`): ``prompt`` + ``chosen`` + ``rejected`` (strings or message lists; plait's
  ``messages`` may stand for the prompt), or the implicit-prompt form: ``chosen`` and ``rejected``
  message lists that share their prompt turns and end in one assistant turn each.
- unpaired preference (`unpaired`, KTO): ``prompt`` + ``completion`` + ``label`` (true:
  desirable).

plait's records: a conversation is a message list, a standard SFT row a `Text`; a pair is ``{"messages", "chosen", "rejected"}``
(the prompt turns and two final assistant answers); an unpaired row is ``{"messages",
"completion", "label"}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from trainer.data.chat import ROLES, Message, Record, Text
from trainer.data.tables import check_unicode

# Other names for the fields (Alpaca's instruction/output, question/answer ...): `trainer.data.tables.rename`.
COLUMNS_FIX = "or map your own field names to these: data.sources.<name>.columns={prompt: question, completion: answer}"
SFT_FIX = (
    "write 'messages' (a list of {role, content}), 'prompt' and 'completion' (or 'response'; strings or message "
    f"lists), or 'text'; {COLUMNS_FIX}"
)
PAIR_FIX = (
    "write 'prompt', 'chosen' and 'rejected' (strings or message lists), or 'chosen' and 'rejected' message lists "
    "that share their prompt; or map your own field names: data.sources.<name>.columns={prompt: question, chosen: "
    "good, rejected: bad}"
)
UNPAIRED_FIX = (
    "write 'prompt', 'completion' (strings or message lists) and 'label' (true: desirable, false: undesirable)"
)


class FormatError(ValueError):
    """A row in none of the accepted formats; the message names the field and the fix."""


def _json_messages(value: Any) -> Any:
    """Messages given as the text of a JSON list of ``{"role": ...}`` objects (a CSV cell can hold
    no list), parsed; any other value (a prompt that merely starts with ``[``) as it is."""
    if not (isinstance(value, str) and value.lstrip().startswith("[")):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    messages = isinstance(parsed, list) and parsed and all(isinstance(m, dict) and "role" in m for m in parsed)
    return parsed if messages else value


def messages(value: Any, field: str, *, role: str) -> list[Message]:
    """A string (one ``role`` turn) or a message list, checked.

    Raises:
        FormatError: neither, or a message without a known role and a string content.
    """
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and not value:
        raise FormatError(f"'{field}' is an empty list; give it the conversation's messages, or remove the row")
    if not isinstance(value, list):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        hint = (
            '; give it as text: in JSON quote it ("42"); a CSV column whose values all look like numbers is '
            "read as numbers, so save such a table as .jsonl or .parquet"
            if number
            else ""
        )
        raise FormatError(f"'{field}' is {type(value).__name__}, not a string or a non-empty list of messages{hint}")
    for m in value:
        if not (isinstance(m, Mapping) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise FormatError(f"'{field}' holds {m!r}; each message needs a role in {ROLES} and a string content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _answer(turns: list[Message], field: str) -> str:
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise FormatError(f"'{field}' must be one assistant turn after the prompt (has {[m['role'] for m in turns]})")
    return turns[0]["content"]


def conversation(row: Mapping[str, Any]) -> Record:
    """The record of an SFT row: a conversation, or a standard row's `Text` (module docstring).

    Raises:
        FormatError: no accepted field set, a field of the wrong type, or messages without an
            assistant turn.
    """
    if "messages" in row:
        turns = messages(row["messages"], "messages", role="user")
        if not any(m["role"] == "assistant" for m in turns):
            raise FormatError(
                "'messages' has no assistant turn, so no token to train on; add the assistant's answer or remove the row"
            )
        return turns
    for answer in ("completion", "response"):
        if "prompt" in row and answer in row:
            if isinstance(row["prompt"], str) and isinstance(row[answer], str):
                return Text(prompt=row["prompt"], completion=row[answer])
            return messages(row["prompt"], "prompt", role="user") + messages(row[answer], answer, role="assistant")
    if "text" in row:
        if not isinstance(row["text"], str):
            raise FormatError(f"'text' is {type(row['text']).__name__}, not a string")
        return Text(prompt="", completion=row["text"])
    raise FormatError(f"has fields {sorted(row)}; {SFT_FIX}")


def pair(row: Mapping[str, Any]) -> dict[str, Any]:
    """The pair of a preference row (module docstring).

    Raises:
        FormatError: a missing field, a response that is not one assistant turn, ``chosen`` and
            ``rejected`` of two kinds (a string and a message list), or implicit-prompt lists
            that share no prompt.
    """
    if not {"chosen", "rejected"} <= row.keys():
        raise FormatError(f"has fields {sorted(row)}; {PAIR_FIX}")
    if {type(row["chosen"]), type(row["rejected"])} == {str, list}:  # another type: `messages` names it
        text, listed = ("chosen", "rejected") if isinstance(row["chosen"], str) else ("rejected", "chosen")
        raise FormatError(
            f"'{listed}' is a message list and '{text}' a string; give both as strings or both as message lists"
        )
    prompt_field = "prompt" if "prompt" in row else ("messages" if "messages" in row else None)
    if prompt_field is not None:
        prompt = messages(row[prompt_field], prompt_field, role="user")
        chosen, rejected = (messages(row[k], k, role="assistant") for k in ("chosen", "rejected"))
    else:
        whole = {k: messages(row[k], k, role="assistant") for k in ("chosen", "rejected")}
        if any(isinstance(row[k], str) for k in whole):
            raise FormatError(f"has no 'prompt' and a string 'chosen' or 'rejected'; {PAIR_FIX}")
        shared = 0
        while shared < min(map(len, whole.values())) - 1 and whole["chosen"][shared] == whole["rejected"][shared]:
            shared += 1
        prompt, chosen, rejected = whole["chosen"][:shared], whole["chosen"][shared:], whole["rejected"][shared:]
        if not prompt:
            raise FormatError(f"'chosen' and 'rejected' share no prompt turn; add 'prompt', or {PAIR_FIX}")
    return {"messages": prompt, "chosen": _answer(chosen, "chosen"), "rejected": _answer(rejected, "rejected")}


def unpaired(row: Mapping[str, Any]) -> dict[str, Any]:
    """The unpaired row of a KTO row (module docstring).

    Raises:
        FormatError: a missing field or a label that is not a boolean.
    """
    if not {"prompt", "completion", "label"} <= row.keys():
        raise FormatError(f"has fields {sorted(row)}; {UNPAIRED_FIX}")
    label = row["label"]
    if not isinstance(label, bool) and label not in (0, 1):
        raise FormatError(f"'label' is {label!r}; use true (desirable) or false (undesirable)")
    completion = _answer(messages(row["completion"], "completion", role="assistant"), "completion")
    return {"messages": messages(row["prompt"], "prompt", role="user"), "completion": completion, "label": bool(label)}


def preference(row: Mapping[str, Any]) -> dict[str, Any]:
    """A pair (`pair`) or, for a row with ``label`` and ``completion`` (or one of them and neither
    ``chosen`` nor ``rejected``), an unpaired row (`unpaired`, whose error names KTO's fields)."""
    kto_field = "label" in row or "completion" in row
    kto = {"label", "completion"} <= row.keys() or (kto_field and not ("chosen" in row or "rejected" in row))
    return unpaired(row) if kto else pair(row)


def read(rows: Iterator[tuple[str, Mapping[str, Any]]], parse: Callable[[Mapping[str, Any]], Any]) -> list[Any]:
    """Every row of ``rows`` (``(where, row)``, `trainer.data.tables.read_rows`) through ``parse``,
    its fields of messages written as JSON text (a CSV's) read as messages (`_json_messages`).

    Raises:
        ValueError: the first malformed row, as ``<file>, line <n>: <problem>; <fix>``.
    """
    out = []
    for where, row in rows:
        row = {key: _json_messages(value) for key, value in row.items()}
        try:
            out.append(parse(row))
        except FormatError as err:
            raise ValueError(f"{where}: {err}") from None
        check_unicode(out[-1], where)  # the fields trained on, not the columns left out
    return out
