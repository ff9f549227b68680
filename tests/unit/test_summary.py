"""summary.json's tokens/s leaves out each process's start-up and first step, and survives a resume."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.callbacks import summary as summary_module
from trainer.callbacks.summary import Summary, headline
from trainer.off_step import OffStepClock


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _steps(callback: Summary, module: SimpleNamespace, clock: Clock, seconds: list[float], tokens: int) -> None:
    for s in seconds:
        clock.now += s
        module.tokens_seen += tokens
        callback.on_train_batch_end(None, module)


def test_tokens_per_s_leaves_out_the_first_step_of_each_process(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(summary_module.time, "perf_counter", clock)
    module = SimpleNamespace(tokens_seen=0, off_step=OffStepClock())
    first = Summary()
    first.on_train_start(None, module)
    _steps(first, module, clock, [30.0, 1.0, 1.0], tokens=100)  # a 30 s first step (compile, warm-up)
    state = first.state_dict()  # a checkpoint after step 3, then the process dies
    assert (state["warm_tokens"], state["warm_s"]) == (200, 2.0)

    resumed = Summary()
    resumed.load_state_dict(state)
    resumed.on_train_start(None, module)
    _steps(resumed, module, clock, [20.0, 2.0], tokens=100)  # this process's first step is slow again
    warm = resumed._warm(module.tokens_seen)
    assert warm == (300, 4.0)  # steps 2, 3 and 5: 300 tokens in 4 s
    out = headline([], tokens_seen=module.tokens_seen, wall_time_s=resumed._elapsed(), steps=5, warm=warm)
    assert out["tokens_per_s"] == 75.0 and out["wall_time_s"] == 54.0


def test_a_one_step_run_falls_back_to_the_whole_wall_time() -> None:
    out = headline([], tokens_seen=512, wall_time_s=4.0, steps=1, warm=(0, 0.0))
    assert out["tokens_per_s"] == 128.0


def test_tokens_per_s_leaves_out_evaluations_and_saves_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run evaluating every step read 1,373 tokens/s against 8,502 evaluating never, at equal step
    times (a reviewer's): the Task's off-step clock (evaluations, saves, exports) is left out."""
    clock = Clock()
    monkeypatch.setattr(summary_module.time, "perf_counter", clock)
    monkeypatch.setattr("trainer.off_step.time.perf_counter", clock)
    module = SimpleNamespace(tokens_seen=0, off_step=OffStepClock())
    callback = Summary()
    callback.on_train_start(None, module)
    for step in range(4):
        clock.now += 1.0  # the step
        module.tokens_seen += 100
        callback.on_train_batch_end(None, module)
        with module.off_step():  # an evaluation after it
            clock.now += 5.0
    assert callback._warm(module.tokens_seen) == (300, 3.0)  # steps 2-4: 300 tokens in 3 s of training
