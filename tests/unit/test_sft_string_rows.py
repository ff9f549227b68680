"""TRL's rule for a user's SFT rows, through the data module a run builds (`trainer.build.build_data`):
a standard row (string ``prompt`` + ``completion``, or ``text``) is plain text, prompt then
completion and EOS, loss on the completion and EOS only, no chat template; a conversational row
(message lists) goes through the chat template; ``string_rows: chat`` renders a standard row as the
conversation it would be."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.build import build_data
from trainer.compose import compose
from trainer.data.packing import IGNORE_INDEX

PROMPT, COMPLETION = "The sky is", " blue."
ROWS = [
    {"prompt": PROMPT, "completion": COMPLETION},
    {"prompt": [{"role": "user", "content": PROMPT}], "completion": [{"role": "assistant", "content": COMPLETION}]},
    {"text": "Roses are red."},
]


def _samples(tmp_path: Path, string_rows: str) -> tuple[list[tuple[list[int], list[int]]], object]:
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    source = f"{{mine: {{source: '{path}', val_size: 0, string_rows: {string_rows}}}}}"
    cfg = compose("sft", [f"data.sources={source}", "data.template=default", "data.vocab_size=300", "model=nano"])
    data = build_data(cfg)
    samples = data.prepare().train["mine"]
    return [(samples.sample(i)[0].tolist(), samples.sample(i)[1].tolist()) for i in range(len(samples))], data.tokenizer


def _expected(ids_by_segment: list[tuple[list[int], bool]]) -> tuple[list[int], list[int]]:
    """Ids joined, labels[t] = ids[t + 1] where token t + 1 is supervised (written here, not plait's)."""
    ids = [t for part, _ in ids_by_segment for t in part]
    supervised = [sup for part, sup in ids_by_segment for _ in part]
    labels = [ids[t + 1] if supervised[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    return ids, labels


def test_standard_rows_are_plain_text_and_conversations_use_the_template(tmp_path: Path) -> None:
    (standard, conversational, text), tok = _samples(tmp_path, "text")
    eos = [tok.eos_id]
    assert standard == _expected([(tok.encode(PROMPT), False), (tok.encode(COMPLETION) + eos, True)])
    assert tok.decode(standard[0]) == PROMPT + COMPLETION + tok.eos_token  # no role markers
    assert conversational == _expected(
        [
            (tok.encode(f"<|user|>\n{PROMPT}\n") + tok.encode("<|assistant|>\n"), False),
            (tok.encode(COMPLETION) + eos, True),
            (tok.encode("\n"), False),
        ]
    )
    assert text == _expected([(tok.encode("Roses are red.") + eos, True)])  # a text row: every next token


def test_string_rows_chat_renders_a_standard_row_as_its_conversation(tmp_path: Path) -> None:
    (standard, conversational, _), _ = _samples(tmp_path, "chat")
    assert standard == conversational
