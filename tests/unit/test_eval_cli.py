"""``plait eval``: scores of a model directory printed and written under ``<dir>/eval/``, added to
by a second evaluation, shown by ``plait compare``; bad arguments exit 2 naming the fix."""

from __future__ import annotations

import json

import pytest
from hf_checkpoints import make_hf_dir

from trainer.compare import table
from trainer.eval import main as plait_eval
from trainer.run_model import load_run_model
from trainer.sampling import sample


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


def test_a_task_of_ones_own_on_local_data(hub, tmp_path, capsys) -> None:
    """``include_path=`` a directory with a task file whose data is a local JSON-lines file: a
    generation task (greedy, cut at the stop string) scored by lm-eval's exact match. The expected
    answers are the model's own greedy continuations (`trainer.sampling.sample`), so both score 1."""
    run = load_run_model(hub)
    rows = []
    for prompt in ("hello", "abc"):
        ids = sample(
            run.model, run.tokenizer.encode(prompt), max_new_tokens=4, temperature=0, top_k=None, max_seq_len=128
        )
        rows.append({"question": prompt, "answer": run.tokenizer.decode(ids)})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "echo.yaml").write_text(
        f"task: my_echo\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\u0000']\n  max_gen_toks: 4\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    plait_eval([f"ckpt={hub}", "tasks=[my_echo]", f"include_path=[{tasks}]"])
    capsys.readouterr()
    assert json.loads((hub / "eval" / "llama.json").read_text())["scores"]["my_echo/exact_match"] == 1.0


def test_scores_go_to_out_and_a_destination_that_cannot_take_them_is_refused_before_scoring(
    hub, tmp_path, capsys
) -> None:
    """out= takes the scores instead of the model's directory (a shared or read-only copy stays
    untouched); a destination that cannot be written is refused before the evaluation runs, naming
    out=, not after it with a traceback."""
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(SystemExit) as exit_:
        plait_eval([f"ckpt={hub}", "tasks=[plait_corpus_next_line]", "limit=2", f"out={blocked / 'scores'}"])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and "give out=<a writable directory>" in out.err and "acc_norm" not in out.out
    before = sorted(p.name for p in hub.rglob("*"))
    plait_eval([f"ckpt={hub}", "tasks=[plait_corpus_next_line]", "limit=2", f"out={tmp_path / 'scores'}"])
    scores = json.loads((tmp_path / "scores" / "llama.json").read_text())["scores"]
    assert set(scores) == {"plait_corpus_next_line/acc", "plait_corpus_next_line/acc_norm"}
    assert sorted(p.name for p in hub.rglob("*")) == before
    # Another model of the same name: its scores would land in that file, mixed with these; refused.
    other = tmp_path / "elsewhere" / hub.name
    make_hf_dir("llama3", other, seed=1)
    with pytest.raises(SystemExit) as exit_:
        plait_eval([f"ckpt={other}", "tasks=[plait_corpus]", "limit=2", f"out={tmp_path / 'scores'}"])
    assert exit_.value.code == 2 and f"holds the scores of another model ({hub.resolve()})" in capsys.readouterr().err


def test_a_moved_model_scores_into_its_own_eval_folder_again(tmp_path, capsys) -> None:
    """Its own eval/ is tied to it by place: moved (or copied to another machine), it was refused as
    'the scores of another model' (its old path)."""
    import shutil

    make_hf_dir("llama3", tmp_path / "a" / "llama")
    plait_eval([f"ckpt={tmp_path / 'a' / 'llama'}", "tasks=[plait_corpus]", "limit=2"])
    shutil.move(tmp_path / "a", tmp_path / "b")
    plait_eval([f"ckpt={tmp_path / 'b' / 'llama'}", "tasks=[plait_corpus_next_line]", "limit=2"])
    scores = json.loads((tmp_path / "b" / "llama" / "eval" / "llama.json").read_text())["scores"]
    assert {"plait_corpus/bits_per_byte", "plait_corpus_next_line/acc"} <= set(scores)
