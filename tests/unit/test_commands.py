"""The command table: dispatch, the preference aliases, each command's --help, and no command
importing the CLI (the former cli <-> generate/export/merge/plan cycle)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trainer.catalog import ALIASES, bundled_recipes, config_groups
from trainer.cli import main
from trainer.commands import COMMANDS, TRAIN, dispatch
from trainer.compose import compose, to_hydra_argv


def test_dispatch_names_a_command_or_trains() -> None:
    assert dispatch(["generate", "ckpt=x"]) == (COMMANDS["generate"], ["ckpt=x"])
    assert dispatch(["plan", "sft", "cluster=cpu"]) == (COMMANDS["plan"], ["sft", "cluster=cpu"])
    assert dispatch(["train", "sft"]) == (TRAIN, ["sft"])
    assert dispatch(["sft", "optim.lr=1"]) == (TRAIN, ["sft", "optim.lr=1"])
    assert dispatch([]) == (TRAIN, [])
    assert dispatch(["--config-path", "d", "--config-name", "sft"])[0] is TRAIN  # a child process's argv
    assert not set(COMMANDS) & set(bundled_recipes()), "a recipe named like a command could never be trained"


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_alias_is_the_preference_recipe_with_its_objective(alias: str) -> None:
    cfg = compose(alias, ["model=nano"])
    implied = ALIASES[alias][1]  # objective=<alias> recipe=<alias>, and kto's data.unpaired=true
    assert {f"objective={alias}", f"recipe={alias}"} <= set(implied)
    # Unresolved: run_dir's ${now:...} is resolved once per config, and two composes may straddle a second.
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(compose("preference", [*implied, "model=nano"]))
    assert cfg.recipe == alias and cfg.objective._target_.lower().endswith("." + alias)
    # The user's overrides come after the alias's, so they win.
    assert compose(alias, ["recipe=mine"]).recipe == "mine"


def test_flags_never_split_the_overrides() -> None:
    """Hydra takes the overrides as one run of arguments: an alias's implied overrides and a flag
    with its value must not leave overrides on both sides (``plait dpo --cfg job`` failed so)."""
    argv = to_hydra_argv(["dpo", "--cfg", "job", "model=nano", "--info", "defaults", "-m"])
    overrides = [i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")]
    assert overrides == list(range(overrides[0], len(argv)))
    assert argv[argv.index("--cfg") + 1] == "job" and argv[argv.index("--info") + 1] == "defaults" and "-m" in argv
    assert to_hydra_argv(argv) == argv  # a child process re-runs it unchanged


@pytest.mark.parametrize("name", ["generate", "chat", "export", "merge", "plan"])
def test_command_help_lists_its_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    main([name, "--help"])
    out = capsys.readouterr().out
    expected = {
        "generate": ["ckpt:", "prompt:", "chat:"],
        "chat": ["ckpt:", "system:"],
        "export": ["ckpt:", "out:", "dtype:"],
        "merge": ["base:", "deltas:", "method:"],
    }
    for word in expected.get(name, [f"{group} " for group in config_groups()]):
        assert word in out, (name, word)
    assert "``" not in out and "Invocations::" not in out  # the docstring as plain text


def test_recipe_help_marks_its_group_choices(capsys: pytest.CaptureFixture[str]) -> None:
    main(["ipo", "model=nano", "--help"])
    out = capsys.readouterr().out
    objective = next(line for line in out.splitlines() if line.split()[:1] == ["objective"])
    assert "*ipo" in objective and "*dpo" not in objective
    assert "*nano" in next(line for line in out.splitlines() if line.split()[:1] == ["model"])
    assert "recipe: ipo" in out and "dim: 64" in out  # the composed config with the override


def test_no_command_imports_the_cli() -> None:
    modules = [c.module for c in COMMANDS.values()] + ["trainer.commands", "trainer.compose"]
    for module in modules:
        path = Path(importlib.util.find_spec(module).origin)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                assert "trainer.cli" not in names, f"{module} imports trainer.cli (line {node.lineno})"


def test_preference_recipe_is_one_file_and_the_aliases_compose_as_before() -> None:
    """The aliases' composed configs keep the fields of the former per-loss recipes."""
    cfg = OmegaConf.to_container(compose("orpo", ["model=nano"]))
    assert cfg["recipe"] == "orpo" and cfg["data"]["_target_"].endswith("PreferenceDataModule")
    assert cfg["train"]["global_batch_size"] == 8 and cfg["trainer"]["max_steps"] == 200


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "ckpt=42"], "ckpt=42 must be text; quote it: ckpt=\"'42'\""),
        (["generate", "ckpt=[a,b]"], "ckpt=['a', 'b'] must be one text, not a list; give one value: ckpt=..."),
        (
            ["generate", "ckpt=/nonexistent", "temperature=hot"],
            "temperature='hot' must be a number, e.g. temperature=0.8",
        ),
        (["generate", "ckpt=/nonexistent", "chat=maybe"], "chat='maybe' must be true or false"),
        (["export", "ckpt=/nonexistent", "out=[a]"], "out=['a'] must be one text, not a list"),
        (["export", "ckpt=/nonexistent", "out=7"], "out=7 must be text"),
        (["merge", "base=/nonexistent", "deltas=runs/a"], "deltas='runs/a' must be a list of texts, e.g. deltas=[a,b]"),
        (["chat", "ckpt=/nonexistent", "trust=numpy"], "trust='numpy' must be a list of texts"),
        # a misspelt argument (Hydra's "Could not override 'temprature'" named no field)
        (
            ["generate", "ckpt=/nonexistent", "temprature=0"],
            "temprature: plait generate has no such argument; did you mean temperature? (it takes ckpt, prompt,",
        ),
    ],
)
def test_a_command_argument_of_the_wrong_type_is_one_error(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``prompt=42`` reached ``cfg.prompt + reply(...)`` (TypeError; the prompt is now taken as
    typed, ``"42"``: tests/unit/test_generate_prompts.py), ``out=[a]`` ``Path([...])``."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("plait: error: ") and err.count("\n") == 1, err
    assert expected in err and "usage: plait " + argv[0] in err
