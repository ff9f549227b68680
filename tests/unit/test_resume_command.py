"""``plait resume RUN_DIR``: the run's own config as the recipe (`trainer.resume_run`), and what a
resume changed (`trainer.resume.free_changes`). The CLI round trip is tests/e2e/test_cli_resume.py (slow)."""

from __future__ import annotations

import shlex

import pytest
from omegaconf import OmegaConf

from trainer.compose import compose
from trainer.resume import free_changes
from trainer.resume_run import main, recipe_for


def _run_dir(tmp_path):
    cfg = compose("sft", ["model=nano", "data=synthetic", "optim.lr=1e-3", "strategy.lora.rank=4"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)  # as trainer.rundir.RunDir.write_config
    return run_dir, OmegaConf.to_container(cfg, resolve=True)


def test_the_saved_config_is_the_recipe(tmp_path) -> None:
    """Composing the run's recipe gives every value it was started with: no override typed again."""
    run_dir, saved = _run_dir(tmp_path)
    again = OmegaConf.to_container(
        compose(str(recipe_for(run_dir)), [f"run_dir={run_dir}", "resume=last"]), resolve=True
    )
    assert {k: v for k, v in again.items() if k not in ("run_dir", "resume")} == {
        k: v for k, v in saved.items() if k not in ("run_dir", "resume")
    }
    assert again["run_dir"] == str(run_dir) and again["resume"] == "last"


def test_free_changes_name_what_a_resume_changed() -> None:
    saved = {
        "trainer": {"max_steps": 100},
        "model": {"dim": 8},
        "run_dir": "a",
        "callbacks": {"checkpoint": {"every_n_steps": 50}},
    }
    new = {
        "trainer": {"max_steps": 200},
        "model": {"dim": 16},
        "run_dir": "b",
        "callbacks": {"checkpoint": {"every_n_steps": 25}},
    }
    assert free_changes(saved, new) == {
        "callbacks.checkpoint.every_n_steps": (50, 25),
        "trainer.max_steps": (100, 200),
    }  # model.* is check_resume's (refused), run_dir the resume's own


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["model=tiny"], "model: a resumed run keeps the options it was started with"),
        (["strategy/lora=default"], "strategy/lora: a resumed run keeps the options"),
    ],
)
def test_group_choices_are_refused_before_anything_starts(tmp_path, capsys, argv, message) -> None:
    run_dir, _ = _run_dir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([str(run_dir), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_strategy_preset_is_refused_with_the_fields_that_give_its_layout(tmp_path, capsys) -> None:
    """``plait resume RUN strategy=tp`` names the overrides that turn the run's strategy into tp's
    (a resumed config has no defaults list); resumed with them, the strategy is a fresh tp run's."""
    run_dir, _ = _run_dir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([str(run_dir), "strategy=tp", "trainer.max_steps=9"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "strategy=tp: a resumed run keeps the options" in err
    fix = err.strip().split("plait resume ", 1)[1].split()
    assert fix[0] == str(run_dir) and fix[-1] == "trainer.max_steps=9" and "strategy.tp=-1" in fix
    resumed = compose(str(recipe_for(run_dir)), [f"run_dir={run_dir}", "resume=last", *fix[1:]])
    fresh = compose("sft", ["model=nano", "data=synthetic", "optim.lr=1e-3", "strategy.lora.rank=4", "strategy=tp"])
    assert OmegaConf.to_container(resumed.strategy, resolve=True) == OmegaConf.to_container(
        fresh.strategy, resolve=True
    )


def _saved_run(tmp_path, recipe: str, overrides: list[str]):
    run_dir = tmp_path / "a run"  # a space: the printed command quotes it
    run_dir.mkdir()
    OmegaConf.save(compose(recipe, overrides), run_dir / "config.yaml", resolve=True)
    return run_dir


def _printed_fix(capsys) -> list[str]:
    err = capsys.readouterr().err.strip()
    return shlex.split(err[err.index("plait resume ") :])


def test_a_strategy_preset_changes_the_layout_and_keeps_the_runs_other_settings(tmp_path, capsys) -> None:
    """trainer=gpu's bf16 FSDP and compile are the run's own choices: strategy=tp's fields leave them."""
    run_dir = _saved_run(tmp_path, "pretrain", ["model=nano", "trainer=gpu", "trainer.devices=8"])
    with pytest.raises(SystemExit):
        main([str(run_dir), "strategy=tp"])
    fix = _printed_fix(capsys)
    assert fix[:3] == ["plait", "resume", str(run_dir)] and "strategy.tp=-1" in fix, fix
    resumed = compose(str(recipe_for(run_dir)), [f"run_dir={run_dir}", "resume=last", *fix[3:]]).strategy
    assert (resumed.tp, resumed.dp_shard, resumed.dp_replicate) == (-1, 1, 1)
    assert resumed.fsdp.param_dtype == "bf16" and resumed.compile.enabled


@pytest.mark.parametrize(
    ("started", "preset", "node"),
    [
        ([], "diloco", "strategy.local_sgd"),  # turns local SGD on
        (["strategy=diloco", "trainer.devices=2"], "fsdp", "strategy.local_sgd"),  # off
        (["strategy=diloco", "trainer.devices=2"], "ist", "strategy.local_sgd"),  # another algorithm
    ],
)
def test_a_strategy_preset_a_resume_cannot_reach_names_a_new_run(tmp_path, capsys, started, preset, node) -> None:
    run_dir = _saved_run(tmp_path, "pretrain", ["model=nano", *started])
    with pytest.raises(SystemExit):
        main([str(run_dir), f"strategy={preset}"])
    err = capsys.readouterr().err
    assert f"{preset} differs from it in {node}, which a resume cannot change" in err
    assert shlex.join(["plait", "pretrain", f"strategy={preset}", f"model.init_from={run_dir}"]) in err


def test_an_unknown_strategy_preset_names_the_closest(tmp_path, capsys) -> None:
    run_dir, _ = _run_dir(tmp_path)
    with pytest.raises(SystemExit):
        main([str(run_dir), "strategy=fdsp"])
    assert "did you mean strategy=fsdp? the strategy options: " in capsys.readouterr().err


def test_a_folder_without_a_config_is_not_a_run(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "is not a plait run directory (no config.yaml" in capsys.readouterr().err


def test_a_sweep_is_refused(tmp_path, capsys) -> None:
    run_dir, _ = _run_dir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([str(run_dir), "--multirun", "trainer.max_steps=3,4"])
    assert exit_.value.code == 2 and "plait resume continues one run; a sweep (--multirun)" in capsys.readouterr().err
