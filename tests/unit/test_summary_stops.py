"""``summary.json`` says what ended a run: a callback that stops it (with the reason it gives), a
stream that runs out, the data's budgets (planned at launch, with the settings to raise). A non-finite step and a stop
signal, which end a run by an exception, are in tests/e2e/test_summary_cli.py (the CLI's
processes see the exception; a forked rank's goes to its parent)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from harness import compose_config, fit

from trainer.build import build_data
from trainer.config import validate
from trainer.run_length import plan_run_length

STOP_AT = 2  # the optimizer step at which the run below is stopped


def _summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


class StopWithReason(L.Callback):
    """Sets ``trainer.should_stop`` after optimizer step ``STOP_AT`` and says why (as mSFT's patience does)."""

    stop_reason: str | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == STOP_AT:
            trainer.should_stop = True
            self.stop_reason = f"the test's own stop after step {STOP_AT}"


def _fit(tmp_path: Path, *overrides: str) -> None:
    fit(compose_config(["trainer.max_steps=6", "callbacks.checkpoint.every_n_steps=0", *overrides]), tmp_path)


def test_a_callback_that_stops_the_run_gives_its_reason(tmp_path: Path) -> None:
    _fit(tmp_path, "+callbacks.stop._target_=test_summary_stops.StopWithReason")
    summary = _summary(tmp_path)
    assert (summary["stopped_by"], summary["steps"], summary["planned_steps"]) == ("callback", STOP_AT, 6)
    assert summary["stop_reason"] == f"the test's own stop after step {STOP_AT}"


def test_a_stream_that_ends_before_max_steps_is_named_when_it_ends(tmp_path: Path) -> None:
    """A stream's length is unknown at launch (nothing planned); its end is still the run's reason."""
    docs = tmp_path / "docs.jsonl"
    with open(docs, "w") as file:
        for i in range(40):
            file.write(json.dumps({"text": " ".join(f"w{(i + j) % 30}" for j in range(60))}) + "\n")
    _fit(
        tmp_path / "run",
        "data=stream",
        f"data.path={docs}",
        "data.eval_docs=4",
        "data.eval_rows=4",
        "trainer.max_steps=1000",
    )
    summary = _summary(tmp_path / "run")
    assert (summary["planned_steps"], summary["stopped_by"]) == (1000, "data_exhausted")
    assert 0 < summary["steps"] < 1000
    assert summary["stop_reason"] == (
        f"data.path is read once and its training documents ran out after {summary['steps']} steps; add documents, "
        "or train epochs over them with data=text"
    )


def _write_chats(path: Path, n: int) -> Path:
    with open(path, "w") as file:
        for i in range(n):
            messages = [{"role": "user", "content": f"count to {i}"}, {"role": "assistant", "content": f"{i} {i + 1}"}]
            file.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_the_budgets_that_end_a_mixture_are_named_with_their_settings(tmp_path: Path) -> None:
    a, b = _write_chats(tmp_path / "a.jsonl", 30), _write_chats(tmp_path / "b.jsonl", 30)
    sources = (
        f"data.sources={{a: {{source: {a}, max_tokens: 40, max_epochs: null}}, b: {{source: {b}, max_epochs: 0.5}}, "
        f"c: {{source: {b}, weight: 0}}}}"
    )
    cfg = compose_config(
        ["model=nano", "data.seq_len=64", "train.global_batch_size=4", sources], recipe="sft", tiny=False
    )
    data = build_data(cfg, validate(cfg))
    steps = data.finite_steps()
    length = plan_run_length(10_000, data)
    assert (length.planned_steps, length.ends_by) == (steps, "data_exhausted")
    assert length.reason == (  # c (weight 0) never draws: it ends nothing
        f"every source of data.sources is spent after {steps} steps (a max_tokens=40, b max_epochs=0.5); "
        "raise data.sources.a.max_tokens or data.sources.b.max_epochs"
    )
    assert length.launch_line() == f"the run ends after {steps} of trainer.max_steps=10000 steps: {length.reason}"
    # A source that does not set the field it must raise: the override that adds it (a plain one is refused).
    one = compose_config(
        ["model=nano", "data.seq_len=64", "train.global_batch_size=4", f"data.sources={{a: {{source: {a}}}}}"],
        recipe="sft",
        tiny=False,
    )
    data = build_data(one, validate(one))
    assert plan_run_length(10_000, data).reason.endswith("; raise +data.sources.a.max_epochs")
    # A max_steps the data outlasts ends the run itself: nothing to say at launch.
    assert plan_run_length(steps, data).launch_line() is None
    assert plan_run_length(steps - 1, data).ends_by == "max_steps"
