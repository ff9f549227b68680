"""`trainer.preflight.preflight_sweep_job`: each ``--multirun`` job's config is validated before the
sweep starts, except what resolves only inside Hydra's job (the CLI round trip with a bad value is
tests/e2e/test_cli_startup.py)."""

from __future__ import annotations

import pytest

from trainer.overrides import compose_overrides
from trainer.preflight import preflight_sweep_job
from trainer.train import to_hydra_argv


def test_a_bad_value_is_refused_naming_the_job(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        preflight_sweep_job(compose_overrides(to_hydra_argv(["optim.lr=abc"])), "optim.lr=abc")
    assert exit_.value.code == 2 and "(in the sweep's job optim.lr=abc)" in capsys.readouterr().err


def test_a_config_that_reads_hydras_job_is_left_to_the_job() -> None:
    """'seed=${hydra:job.num}' (a sweep's usual per-job seed) was refused as unresolvable before the
    sweep started, where it worked before jobs were validated. Mutation: validating it anyway exits 2."""
    preflight_sweep_job(compose_overrides(to_hydra_argv(["seed=${hydra:job.num}"])), "optim.lr=0.001")
