"""A recipe's learning rate follows what the run starts from (`trainer.finetune_defaults`): plait's
scale from scratch or a plait run, TRL's from a Hugging Face model, about 10x that with LoRA; an
``optim.lr`` override wins, and the launch line names the choice."""

from __future__ import annotations

import pytest
from hf_checkpoints import make_hf_dir

from trainer.compose import compose
from trainer.finetune_defaults import lr_line


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("hub") / "llama"
    make_hf_dir("llama3", directory)
    return str(directory)


@pytest.mark.parametrize(
    ("recipe", "scratch", "hub_lr", "hub_lora"),
    [("sft", 3e-3, 2e-5, 2e-4), ("dpo", 5e-4, 1e-6, 5e-6), ("kto", 5e-4, 1e-6, 5e-6), ("grpo", 1e-4, 1e-6, 1e-5)],
)
def test_the_rate_follows_the_start(hub, tmp_path, recipe, scratch, hub_lr, hub_lora) -> None:
    assert compose(recipe, ["model=nano"]).optim.lr == scratch
    from_hub = compose(recipe, ["model=hf", f"model.init_from={hub}"])
    assert from_hub.optim.lr == hub_lr
    assert "fine-tuning a Hugging Face model (" in lr_line(from_hub)
    with_lora = compose(recipe, ["model=hf", f"model.init_from={hub}", "strategy.lora.rank=16"])
    assert with_lora.optim.lr == hub_lora and "with LoRA (" in lr_line(with_lora)
    chosen = compose(recipe, ["model=hf", f"model.init_from={hub}", "optim.lr=3e-5"])
    assert chosen.optim.lr == 3e-5 and lr_line(chosen) is None


def test_recipe_help_names_the_rate_the_command_line_gets(hub, capsys) -> None:
    """``plait sft ... --help`` shows ``lr: ${plait.lr:...}`` in the config; the line after it says which."""
    from trainer.compose import register_resolvers, to_hydra_argv
    from trainer.train import print_recipe_help

    register_resolvers()
    print_recipe_help(to_hydra_argv(["sft", "model=hf", f"model.init_from={hub}", "--help"]))
    assert (
        capsys.readouterr()
        .out.rstrip()
        .splitlines()[-1]
        .startswith("optim.lr=2e-05: the sft recipe's rate fine-tuning")
    )
