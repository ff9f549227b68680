"""``plait eval``: scores of a model directory printed and written under ``<dir>/eval/``, added to
by a second evaluation, shown by ``plait compare``; bad arguments exit 2 naming the fix."""

from __future__ import annotations

import json

import pytest
from hf_checkpoints import make_hf_dir

from trainer.compare import table
from trainer.eval import main as plait_eval


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hub") / "llama"
    make_hf_dir("llama3", directory)
    return directory


def test_scores_are_printed_written_and_compared(hub, capsys) -> None:
    plait_eval([f"ckpt={hub}", "tasks=[plait_corpus_next_line]", "limit=3"])
    out = capsys.readouterr()
    assert "plait_corpus_next_line" in out.out and "acc_norm" in out.out
    path = hub / "eval" / "llama.json"
    assert f"plait: scores written to {path}" in out.err
    first = json.loads(path.read_text())
    assert set(first["scores"]) == {"plait_corpus_next_line/acc", "plait_corpus_next_line/acc_norm"}
    assert first["results"]["plait_corpus_next_line"]["sample_len"] == 3
    plait_eval([f"ckpt={hub}", "tasks=[plait_corpus]", "limit=2"])  # a second task joins the first
    scores = json.loads(path.read_text())["scores"]
    assert scores["plait_corpus_next_line/acc"] == first["scores"]["plait_corpus_next_line/acc"]
    assert scores["plait_corpus/bits_per_byte"] > 0
    assert "plait_corpus/bits_per_byte" in table([hub]).splitlines()[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tasks=[no_such_task]"], "unknown lm-eval task(s) no_such_task"),
        (["tasks=[]"], "tasks=[] names no task"),
        (["include_path=[/no/such/dir]"], "include_path: /no/such/dir is not a directory"),
    ],
)
def test_bad_arguments_exit_2_naming_the_fix(hub, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        plait_eval([f"ckpt={hub}", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
