"""`trainer.callbacks.throughput.Throughput` logs on the steps that write a row: every
``log_every_n_steps``, the run's last step, and the last step of data that ended before
``max_steps`` (an SFT run whose budgets ran out at step 8 of 40 logged no tokens/s at all: a
reviewer's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.callbacks.throughput import Throughput


class Module(SimpleNamespace):
    def __init__(self, ended: bool) -> None:
        super().__init__(last_step_tokens=512, flops_per_token=1e6, rows=[], ended=ended)

    def data_ended(self) -> bool:
        return self.ended

    def log(self, *args, **kwargs) -> None:
        pass

    def record(self, metrics: dict[str, float]) -> None:
        self.rows.append(metrics)


@pytest.mark.parametrize(
    ("step", "ended", "logged"), [(8, True, True), (8, False, False), (10, False, True), (40, False, True)]
)
def test_a_step_is_logged_when_it_writes_a_row(step: int, ended: bool, logged: bool) -> None:
    trainer = SimpleNamespace(global_step=step, log_every_n_steps=10, max_steps=40, world_size=1)
    module, callback = Module(ended), Throughput(peak_tflops=1.0)
    callback.on_train_batch_start(trainer, module)
    callback.on_train_batch_end(trainer, module)
    assert bool(module.rows) == logged
    if logged:
        assert set(module.rows[0]) == {"perf/tokens_per_s", "perf/tflops", "perf/mfu"}
