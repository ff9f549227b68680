"""plait: train LLMs with Lightning + Hydra. ``plait [COMMAND] [RECIPE] [hydra overrides]``.

Invocations::

    plait                                             # pretrain recipe, CPU, bundled corpus
    plait pretrain trainer.devices=2                  # 2 processes (gloo on CPU)
    plait pretrain trainer.accelerator=gpu trainer.devices=1 trainer.precision=bf16-mixed
    torchrun --nproc-per-node 8 -m trainer.cli pretrain trainer.devices=8   # processes started by torchrun
    plait my_recipes/long.yaml trainer.max_steps=2000 # a recipe file of your own
    plait pretrain --multirun optim.lr=1e-3,3e-4      # Hydra sweep, one run directory per job
    plait dpo                                         # = plait preference objective=dpo (also ipo, simpo, orpo, kto)
    plait generate ckpt=runs/pretrain prompt="To be"  # sample from the newest checkpoint
    plait plan model=llama3_8b cluster=h100x8 data.seq_len=8192   # ranked layouts, no training
    plait merge base=runs/base deltas=[runs/sft,runs/dpo] method=ties   # PAFT merge of fine-tuned deltas
    plait export ckpt=runs/sft out=exports/sft        # a checkpoint as a Hugging Face directory
    plait sft model=hf model.init_from=/models/Qwen3-0.6B  # start from a Hugging Face checkpoint
    plait --user-path . pretrain strategy._target_=my_pkg.MyStrategy   # your own code, from a folder you name

``plait COMMAND --help`` describes a command; ``plait RECIPE --help`` a recipe's groups and config.
The commands are the table of `trainer.commands`; this module only dispatches.
"""

from __future__ import annotations

import sys

from trainer.user_path import UserPathError, drop_current_folder, split_user_path, use_user_path, user_folders

if __name__ == "__main__":  # python -m put the current folder first on the path: off it before any other import
    drop_current_folder()

from trainer.catalog import HELP_FLAGS, bundled_recipes, config_groups, fail  # noqa: E402
from trainer.commands import COMMANDS, dispatch, plain_text  # noqa: E402
from trainer.quiet import quiet_third_party  # noqa: E402


def print_help() -> None:
    """``plait --help``: the invocations, the commands, the recipes and the config groups."""
    lines = [plain_text(__doc__.split("\n\n``plait COMMAND")[0]), "", "Commands (plait COMMAND --help):"]
    lines += [f"  {c.name:<12} {c.summary}" for c in COMMANDS.values()]
    lines += ["", "Recipes (plait RECIPE):"]
    lines += [f"  {name:<12} {text}" for name, text in bundled_recipes().items()]
    lines += ["", "Config groups (GROUP=OPTION), every field is also an override (e.g. optim.lr=1e-3):"]
    lines += [f"  {name:<12} {', '.join(options)}" for name, options in config_groups().items()]
    lines += ["", "plait RECIPE --help shows a recipe's choices and composed config; --cfg job prints it."]
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``plait`` (and of ``python -m trainer.cli``, torchrun's).

    Imports a user's code only from the folders named with ``--user-path DIR`` or ``PLAIT_USER_PATH``,
    never from the current folder (`trainer.user_path`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        flagged, argv = split_user_path(argv)
        use_user_path(user_folders(flagged))
    except UserPathError as err:
        fail(str(err))
    quiet_third_party()
    if argv and argv[0] in HELP_FLAGS:
        return print_help()
    if argv and argv[0] in ("--version", "-V"):  # plait's own (Hydra answers --version with its own)
        from importlib.metadata import version  # lazy: only this flag needs it

        return print(f"plait {version('plait')}")
    command, rest = dispatch(argv)
    command.main(rest)


if __name__ == "__main__":
    main()
