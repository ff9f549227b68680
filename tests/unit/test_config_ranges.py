"""Out-of-range numbers in a config are refused by validate, each naming the key and its range:
declared ranges of plait's own signatures (also through ``**settings``), NaN/inf for every numeric
field, the optimizer's own checks (its constructor and one step), the known
compile backends; an unlaunchable layout is refused at launch."""

from __future__ import annotations

import pytest
from harness import compose_config

from strategies.core.ranges import Range, value_problem
from strategies.runtime.launch import launch_problems
from trainer.config import ConfigError, validate


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=inf", "optim.lr=inf must be a finite number"),
        ("optim.betas=[1.5,0.999]", "optim: Invalid beta parameter at index 0: 1.5"),
        ("scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio=2 must be in [0, 1]"),
        ("data.vocab_size=10", "data.vocab_size=10 must be >= 258"),  # declared by the base, passed as **settings
        ("train.max_grad_norm=-1", "train.max_grad_norm=-1 must be >= 0"),
        ("strategy.heartbeat_s=900", "strategy.heartbeat_s=900 must be below strategy.timeout_s=120"),
        (
            "optim.betas=[0.9,0.95,0.99]",
            "optim: its first step fails (too many values to unpack (expected 2)) with "
            "lr=0.003, betas=[0.9, 0.95, 0.99]",
        ),  # read only by step()
        ("scheduler.decay=cosin", "scheduler.decay='cosin' must be one of cosine, linear, constant"),
        ("trainer.accelerator=tpu", "trainer.accelerator='tpu' must be one of auto, cpu, gpu, cuda"),
        ("model.max_seq_len=10000000000", "model.max_seq_len=10000000000 must be in [1, 16777216]"),
        ("callbacks.progress.refresh_interval_s=-1", "callbacks.progress.refresh_interval_s=-1 must be >= 0"),
    ],
)
def test_out_of_range_values_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config([override]))
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems


def test_an_unknown_compile_backend_is_refused_when_compiling() -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["strategy.compile.enabled=true", "strategy.compile.backend=inductr"]))
    assert any(
        p.startswith("strategy.compile.backend='inductr' is not a torch.compile backend; use one of")
        and "inductor" in p
        for p in err.value.problems
    ), err.value.problems
    validate(compose_config(["strategy.compile.enabled=true", "strategy.compile.backend=aot_eager"]))


def test_range_text_and_membership() -> None:
    assert str(Range(min=0, min_open=True)) == "> 0" and str(Range(min=0, max=1, max_open=True)) == "in [0, 1)"
    assert 0 not in Range(min=0, min_open=True) and 1 not in Range(min=0, max=1, max_open=True)
    assert value_problem("x", float("nan"), None) == "x=nan must be a finite number"
    assert value_problem("x", True, Range(min=2)) is None  # booleans are not numbers here


def test_unlaunchable_layouts() -> None:
    assert "needs a launcher that starts plait on every node" in launch_problems("cpu", 1, 2, environ={})[0]
    assert launch_problems("cpu", 1, 2, environ={"SLURM_NTASKS": "2"}) == []
    assert launch_problems("cpu", 4, 1, environ={}) == []


def test_a_run_dir_that_is_or_sits_under_a_file_is_refused(tmp_path) -> None:
    from omegaconf import OmegaConf

    from trainer.run import check_run_dir

    (tmp_path / "a_file").write_text("x\n")
    for run_dir in (tmp_path / "a_file", tmp_path / "a_file" / "run"):
        with pytest.raises(ConfigError, match="a_file is a file, not a directory; choose another run_dir"):
            check_run_dir(OmegaConf.create({"run_dir": str(run_dir), "resume": None}))
    assert check_run_dir(OmegaConf.create({"run_dir": str(tmp_path / "new"), "resume": None})) is None


def test_float16_weights_refuse_an_adam_eps_float16_cannot_hold() -> None:
    """trainer.precision=16-true keeps Adam's moments in float16: eps=1e-8 (AdamW's default) rounds
    to 0 and the run blew up at step 3 (loss 8.3 -> 10.0), stopped as diverged naming the learning
    rate. Refused naming bf16 or a larger eps; eps=1e-4 and bf16-true are accepted.
    Mutation: dropping fp16_problems from validate accepts the default."""
    from harness import compose_config

    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose_config(["trainer.precision=16-true"]))
    assert any("optim.eps=1e-08 is below the smallest normal value" in p for p in err.value.problems)
    validate(compose_config(["trainer.precision=16-true", "optim.eps=1e-4"]))
    validate(compose_config(["trainer.precision=bf16-true"]))
