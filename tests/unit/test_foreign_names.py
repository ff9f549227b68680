"""Option names from TRL, LitGPT and torchtune are refused naming plait's override (trainer.foreign_names),
through the CLI's own error path (trainer.overrides), and every row of the table names a real override."""

from __future__ import annotations

import re

import pytest
from harness import plait
from omegaconf import DictConfig

from trainer.catalog import config_groups
from trainer.compose import compose, to_hydra_argv
from trainer.config import ConfigError, validate
from trainer.foreign_names import FOREIGN_NAMES
from trainer.overrides import compose_overrides
from trainer.train import print_recipe_help


def _problems(recipe: str, *overrides: str) -> list[str]:
    return compose_overrides(to_hydra_argv([recipe, *overrides])).problems


def test_foreign_options_are_refused_naming_plait_overrides() -> None:
    """Before: ``plait dpo learning_rate=1e-6`` said only "(unknown key)"."""
    typed = ["learning_rate=1e-6", "per_device_train_batch_size=4", "lora_r=16", "max_seq_length=512"]
    result = plait("dpo", *typed, "model_name_or_path=/models/qwen", "trainer.max_steps=2")
    assert result.returncode == 2, result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 5, result.stderr
    for given, fix in zip(
        [*typed, "model_name_or_path=/models/qwen"],
        [
            "use optim.lr=1e-6",
            "use train.micro_batch_size=4",
            "use strategy.lora.rank=16",
            "use data.seq_len=512",
            "use model=hf model.init_from=/models/qwen",
        ],
    ):
        assert any(p.startswith(f"  - {given}:") and fix in p for p in problems), (given, fix, result.stderr)


def test_a_close_spelling_of_plait_key_and_a_misspelt_foreign_name() -> None:
    assert _problems("sft", "train.micro_batch=3") == [
        "train.micro_batch=3: Could not override 'train.micro_batch'. "
        "(unknown key; did you mean train.micro_batch_size?)"
    ]
    assert _problems("sft", "optim.lerning_rate=1")[0].endswith("(unknown key; did you mean optim.lr=1?)")
    assert _problems("pretrain", "strategy.cp_mode=ring")[0].endswith(
        "use strategy.context_parallel.mode=ring; moved into its plugin's node)"
    )
    # a key close to one of its node's is a misspelling; a loose likeness loses to a foreign name
    assert _problems("sft", "model.max_seq_length=512")[0].endswith("did you mean model.max_seq_len?)")
    assert "use data.sources.<name>.max_epochs=3" in _problems("sft", "trainer.num_train_epochs=3")[0]
    # a foreign name that is plait's own key where it is missing is not "fixed" into itself
    assert _problems("sft", "objective.beta=0.1")[0].endswith(
        "(unknown key; if trainer.objectives.sft.SFT takes beta, add it with +objective.beta=0.1)"
    )


def test_a_setting_the_target_takes_but_the_config_lacks_is_added_with_plus() -> None:
    """A reviewer: ``strategy.local_sgd.outer_optimizer.weight_decay=0.1`` said "use optim.weight_decay=0.1"
    (the inner optimizer's: a foreign-name match on the last part), and an argument a user's subclass
    adds said only "(unknown key)"; both are arguments of the node's ``_target_``."""
    problem = _problems("pretrain", "strategy=diloco", "strategy.local_sgd.outer_optimizer.weight_decay=0.1")[0]
    assert problem.endswith(
        "(a setting of torch.optim.SGD that the config does not list; "
        "add it with +strategy.local_sgd.outer_optimizer.weight_decay=0.1)"
    ), problem
    # a foreign name that moves the same name to another node still answers in a group's own node
    # (a reviewer: these said "did you mean model.max_seq_len?" / "optim.fused?" for a while)
    assert _problems("pretrain", "model.seq_len=64")[0].endswith("(unknown key; use data.seq_len=64)")
    assert _problems("pretrain", "optim.seed=1")[0].endswith("(unknown key; use seed=1)")
    assert _problems("pretrain", "model.max_steps=3")[0].endswith("(unknown key; use trainer.max_steps=3)")
    # in a group's own node the hint is said, not checked (checking imports torch: a typo must not wait for it)
    assert _problems("pretrain", "optim.amsgrad=true")[0].endswith(
        "(unknown key; if torch.optim.AdamW takes amsgrad, add it with +optim.amsgrad=true)"
    )
    # a misspelt argument is still a misspelling, and **kwargs does not make every name a setting
    assert _problems("pretrain", "strategy=diloco", "strategy.local_sgd.sync_evry=4")[0].endswith(
        "(unknown key; did you mean strategy.local_sgd.sync_every?)"
    )


def _has(cfg: DictConfig, key: str) -> bool:
    """Whether the dotted ``key`` is a field of ``cfg`` (``<name>``: the first child of that node)."""
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return False
        if part == "<name>":
            part = next(iter(node))
        if part not in node:
            return False
        node = node[part]
    return True


def test_each_row_names_overrides_plait_takes() -> None:
    """A renamed field of conf/ (or a typo in the table) fails here, not in front of a user."""
    recipes = [compose("dpo", ["strategy.lora.rank=8"]), compose("sft")]  # objective.beta, LoRA on; SFT sources
    wrong = []
    for name, row in FOREIGN_NAMES.items():
        for key in re.findall(r"(?:^|\s)([\w.<>]+)=", row.split(";")[0]):
            if "." in key:
                found = any(_has(cfg, key) for cfg in recipes)
            else:  # a config group or a top-level field
                found = key in config_groups() or key in recipes[0]
            if not found:
                wrong.append(f"{name}: {key}")
    assert wrong == []


def test_a_foreign_name_added_with_plus_is_named_by_validate() -> None:
    """``+learning_rate=...`` composes (Hydra adds the key); validate refuses it naming optim.lr."""
    with pytest.raises(ConfigError) as err:
        validate(compose("sft", ["model=nano", "+learning_rate=2e-5", "+optim.warmup_ratio=0.1"]))
    assert any(p.startswith("unknown key learning_rate (use optim.lr=2e-05);") for p in err.value.problems)
    assert any(
        p.startswith("unknown key optim.warmup_ratio (use scheduler.warmup_steps=<warmup_ratio x trainer.max_steps>")
        for p in err.value.problems
    ), err.value.problems


def test_near_misses_at_ones_own_data_name_both_forms() -> None:
    """Before: ``plait sft data.path=mine.jsonl`` (pretraining's key) and ``data.sources.mine.source=...``
    (a new source without ``+``) said only "Could not override"."""
    both = "your file alone: 'data.sources={mine: {source: mine.jsonl}}', or beside the preset's: +data.sources.mine.source=mine.jsonl"
    assert _problems("sft", "data.path=mine.jsonl")[0].endswith(f"{both})")
    assert _problems("sft", "data.sources.mine.source=mine.jsonl")[0].endswith(f"{both})")
    assert "the preset's: copy" in _problems("dpo", "data=preference_synthetic", "data.sources.pairs.source=p.jsonl")[0]


def test_a_field_a_sources_mapping_does_not_set_is_added_with_plus() -> None:
    """``data.sources={mine: {...}} data.sources.mine.max_epochs=3``: the mapping has only the fields
    it names, so Hydra refuses the plain override; the hint named that same override before."""
    (problem,) = _problems("sft", "data.sources={mine: {source: mine.jsonl}}", "data.sources.mine.max_epochs=3")
    assert problem.endswith("(data.sources.mine sets no max_epochs: add it with +data.sources.mine.max_epochs=3)")
    assert _problems("sft", "data.sources={mine: {source: mine.jsonl}}", "+data.sources.mine.max_epochs=3") == []
    # Not for a + of a field the source sets (Hydra: already there), nor for a deletion.
    for typed in ("+data.sources.general.max_epochs=3", "~data.sources.general.nosuch"):
        assert "sets no" not in _problems("sft", typed)[0], typed


def test_an_unknown_group_option_names_the_closest_and_the_options() -> None:
    """Before: ``plait pretrain model=tiney`` said only "Could not find 'model/tiney'"."""
    (problem,) = _problems("pretrain", "model=tiney")
    assert problem.startswith("model=tiney: ") and "(did you mean model=tiny? the model options: " in problem
    assert "nano" in problem.split("the model options: ")[1]


def test_a_group_option_added_where_the_recipe_picks_one_says_to_drop_the_plus() -> None:
    """Before: ``plait sft +budget=msft`` said "Multiple values for budget. To override a value use
    'override budget: msft' (unknown key)"."""
    for recipe, typed, fix in [("sft", "+budget=msft", "budget=msft"), ("pretrain", "+model=nano", "model=nano")]:
        (problem,) = _problems(recipe, typed)
        assert problem.endswith(
            f"(the recipe already picks a {fix.split('=')[0]}; to choose another, {fix} without the '+')"
        )
    assert _problems("sft", "budget=msft") == []


def test_a_flag_of_another_trainer_names_the_override(capsys) -> None:
    """Before: ``plait pretrain --max_steps 5`` said "5: LexerNoViableAltException"; Hydra's own
    flags still pass."""
    for argv, fix in [
        (
            ["pretrain", "--max_steps=5"],
            "--max_steps=5: plait takes overrides as key=value, not flags: trainer.max_steps=5",
        ),
        (
            ["sft", "--learning_rate", "2e-5"],
            "--learning_rate: plait takes overrides as key=value, not flags: optim.lr=",
        ),
        (
            ["pretrain", "--no_such_flag"],
            "--no_such_flag: plait takes overrides as key=value, not flags: no_such_flag=...",
        ),
    ]:
        with pytest.raises(SystemExit) as raised:
            to_hydra_argv(argv)
        assert raised.value.code == 2 and fix in capsys.readouterr().err
    assert "--cfg" in to_hydra_argv(["pretrain", "--cfg", "job", "optim.lr=1e-3"])
    assert "-m" in to_hydra_argv(["pretrain", "-m", "optim.lr=1e-3,3e-4"])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("defaults: [sft, _self_]\ntrainer: {max_steps: 5\n", "is not valid YAML: while parsing a flow mapping"),
        ("defaults: [sftt, _self_]\n", "Could not load 'sftt'. (did you mean sft? the bundled recipes: dpo,"),
        (
            "defaults:\n  - sft\n  - override model: nanoo\n  - _self_\n",
            "Could not find 'model/nanoo' (did you mean nano? the model options:",
        ),
    ],
    ids=["yaml", "recipe", "group_option"],
)
def test_a_broken_recipe_file_is_one_problem_with_its_fix(tmp_path, capsys, body: str, says: str) -> None:
    """A recipe file that does not compose by itself was reported once per override (each 'Could
    not load'), without the options, or as a YAML traceback (a new user's walkthrough)."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(body)
    with pytest.raises(SystemExit) as exited:
        compose_overrides(to_hydra_argv([str(recipe), "trainer.max_steps=1", "seed=3"]))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count(f"  - {recipe}") == 1 and says in err, err


def test_a_recipe_folders_own_group_options_are_suggested(tmp_path, capsys) -> None:
    """A recipe file's folder holds groups of the user's own (my_recipes/objective/scaled.yaml): a
    misspelled option was answered with the bundled options only, and a +option the recipe already
    picks without the drop-the-+ hint (a reviewer's)."""
    (tmp_path / "objective").mkdir()
    (tmp_path / "objective" / "scaled.yaml").write_text("_target_: trainer.objectives.pretrain.CausalLM\n")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults: [pretrain, _self_]\n")
    for typed, says in (
        ("objective=scaledd", "did you mean objective=scaled? the objective options: causal_lm,"),
        (
            "+objective=scaled",
            "the recipe already picks a objective; to choose another, objective=scaled without the '+'",
        ),
    ):
        with pytest.raises(SystemExit):
            compose_overrides(to_hydra_argv([str(recipe), typed])).refuse_typed()
        err = capsys.readouterr().err
        assert says in err, err
    assert "scaled" in config_groups(tmp_path)["objective"] and "scaled" not in config_groups()["objective"]
    recipe.write_text("defaults: [pretrain, {override objective: scaled}, _self_]\n")
    print_recipe_help(to_hydra_argv([str(recipe), "--help"]))  # the recipe's help lists and stars its folder's option
    assert "*scaled" in next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  objective"))


def test_a_group_option_in_a_recipe_files_body_names_the_defaults_list() -> None:
    cfg = compose("pretrain")
    cfg.model = "nano"
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert any(p.endswith("nano is a model option: choose it in the defaults list (- override model: nano) or as model=nano")
               for p in err.value.problems), err.value.problems  # fmt: skip
