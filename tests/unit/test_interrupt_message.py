"""Ctrl-C (SIGINT) stops a run without a checkpoint (SIGTERM saves one): the launching rank says
which steps are lost and how to continue, or that nothing can be resumed."""

from __future__ import annotations

from types import SimpleNamespace

from trainer.callbacks.checkpoint import PeriodicCheckpoint


def _interrupted(
    tmp_path, *, step: int, last_saved: int, started: bool = True, exception=None, in_flight: int | None = None
) -> None:
    callback = PeriodicCheckpoint(dirpath=str(tmp_path / "run" / "checkpoints"), save_on_signal=False)
    trainer = SimpleNamespace(global_step=step, is_global_zero=True, ckpt_path=None)
    if started:
        callback.on_train_start(trainer, None)
    callback.load_state_dict({"last_saved": last_saved})
    if in_flight is not None:  # a background save started, never sealed (no writer here to finish it)
        callback._last_saved = in_flight
    callback.on_exception(trainer, None, exception or KeyboardInterrupt())


def test_ctrl_c_names_the_lost_steps_and_the_resume(tmp_path, capsys) -> None:
    _interrupted(tmp_path, step=7, last_saved=4)
    assert capsys.readouterr().err == (
        f"plait: interrupted (Ctrl-C) after step 7: steps 5-7 are not saved; continue from step 4 with plait resume "
        f"{tmp_path / 'run'} (SIGTERM, kill -TERM <pid>, stops with a checkpoint of the current step)\n"
    )
    # A background save of step 6 that never completed: the newest complete checkpoint is still step 4.
    _interrupted(tmp_path, step=7, last_saved=4, in_flight=6)
    assert "steps 5-7 are not saved; continue from step 4 with" in capsys.readouterr().err
    _interrupted(tmp_path, step=3, last_saved=-1)
    assert "no checkpoint was written, the run cannot be resumed" in capsys.readouterr().err
    # A crash says nothing here (its traceback does), nor does a process that trained nothing (a fork
    # launcher's parent).
    _interrupted(tmp_path, step=3, last_saved=2, exception=RuntimeError("boom"))
    _interrupted(tmp_path, step=3, last_saved=2, started=False)
    assert capsys.readouterr().err == ""
