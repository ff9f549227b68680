"""``plait data``: the samples a run trains, decoded, with exactly the supervised tokens marked.

On the bundled synthetic tasks the marked part of every sample shown is the task's answer (worked
out here from the prompt) followed by EOS, and the prompt is unmarked; a preference pair shows its
chosen (the copy) and rejected (another answer) rows after the same prompt; the token counts of
one pass equal those of the prepared data."""

from __future__ import annotations

import re

import pytest

from trainer import preview
from trainer.data.preview import Sample, marks, render

EOS = "<|endoftext|>"
SMALL = ["model=nano", "data.sources.reversal.limit=40", "data.sources.sorting.limit=40"]
SMALL += ["data.sources.addition.limit=40"]
SHOWN = re.compile(r"^-- (\w+): sample \d+ ?(\w*)[^\n]*\n(.*?)(?=\n\n--|\n\nper source|\n\n==)", re.M | re.S)


def _answer(task: str, prompt: str) -> str:
    """The synthetic task's answer to ``prompt`` (trainer.data.synthetic), worked out here."""
    symbols = prompt.split(": ", 1)[1]
    if task == "reversal":
        return " ".join(symbols.split()[::-1])
    if task == "sorting":
        return " ".join(sorted(symbols.split()))
    a, b = ("".join(side.split()) for side in symbols.split(" + "))
    return " ".join(str(int(a) + int(b)))


def _shown(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, list[tuple[str, str, str]]]:
    preview.main(argv)
    out = capsys.readouterr().out
    return out, SHOWN.findall(out)


def test_the_marked_part_of_each_sample_is_its_answer(capsys) -> None:
    out, shown = _shown(["sft", "data=synthetic", *SMALL, "n=2"], capsys)
    assert sorted(name for name, _, _ in shown) == ["addition"] * 2 + ["reversal"] * 2 + ["sorting"] * 2
    for task, _, text in shown:
        prompt = re.fullmatch(rf"<\|user\|>\n(.*)\n<\|assistant\|>\n«(.*)»\n", text, re.S)
        assert prompt is not None, text  # one marked span, after the unmarked prompt
        assert "«" not in prompt[1] and prompt[2] == _answer(task, prompt[1]) + EOS
    tokens = int(re.search(r"data: [\d,]+ training samples \(([\d,]+) tokens\)", out)[1].replace(",", ""))
    table = out.split("\nsource ", 1)[1].splitlines()[1:4]
    assert sum(int(row.split()[-2].replace(",", "")) for row in table) == tokens  # one pass trains every token


def test_a_preference_pair_shows_chosen_and_rejected(capsys) -> None:
    argv = ["dpo", "data=preference_synthetic", "model=nano", "data.sources.copy.limit=40", "n=1"]
    _, shown = _shown(argv, capsys)
    (_, first, chosen), (_, second, rejected) = shown
    assert (first, second) == ("chosen", "rejected")
    prompt, answer = re.fullmatch(r"<\|user\|>\ncopy: (.*)\n<\|assistant\|>\n«(.*)»", chosen).groups()
    assert answer == prompt + EOS
    assert rejected.startswith(f"<|user|>\ncopy: {prompt}\n<|assistant|>\n«") and rejected != chosen


def test_marks_follow_the_pre_shifted_labels() -> None:
    class Chars:  # a tokenizer whose ids are characters
        def decode(self, ids):
            return "".join(map(chr, ids))

    ids = [ord(c) for c in "Q?A!"]
    sample = Sample("s", ids, [-100, ids[2], ids[3], -100], "here")
    assert render(Chars(), ids, marks(sample.labels)) == "Q?«A!»" and sample.mismatched == 0
    assert Sample("s", ids, [-100, ids[1], -100, -100], "here").mismatched == 1  # a label that is not the next token


def test_bad_options_name_the_fix(capsys) -> None:
    for argv, says in ((["n=0"], "n=0 must be a whole number >= 1"), (["count=maybe"], "count=maybe must be true")):
        with pytest.raises(SystemExit) as exited:
            preview.main(["sft", *argv])
        assert exited.value.code == 2 and says in capsys.readouterr().err
