"""``plait plan [RECIPE] overrides``: rank parallel layouts before training; ``planner.check``.

Invocations::

    plait plan model=llama3_8b data.seq_len=8192 train.global_batch_size=16 cluster=h100x8
    plait plan model=llama3_70b cluster=h100x256 train.global_batch_size=512 trainer.precision=bf16-mixed
    plait plan model=nano cluster=cpu trainer.devices=2 planner.calibrate=true   # measure this machine first
    plait pretrain planner.check=true cluster=h100x8 model=llama3_8b ...        # fail a predicted OOM

The config is composed exactly as for a run (same recipe, same overrides), so the model, sequence
length, global batch, precision and optimizer are the run's; ``cluster=`` names the machine.
"""

# The planning itself is `trainer.planning`; this module parses the arguments and prints.

from __future__ import annotations

import sys

from trainer.compose import compose, fail, split_recipe, to_hydra_argv
from trainer.overrides import compose_overrides

# trainer.config, trainer.planning and trainer.targets import torch and Lightning (~5 s): imported
# once the overrides apply, so that a mistyped one is answered at once, as by the train command.


def main(argv: list[str]) -> None:
    """Entry of ``plait plan``: compose like a run, validate, print the plan; exit 2 on bad config."""
    recipe, overrides = split_recipe(argv)
    compose_overrides(to_hydra_argv(argv)).refuse_typed()  # every mistyped override, each with its fix
    from trainer.config import ConfigError, validate  # lazy: Lightning (see the imports above)
    from trainer.planning import plan  # lazy: Lightning (see the imports above)
    from trainer.targets import UntrustedTargetError  # lazy: torch (see the imports above)

    try:
        cfg = compose(recipe, overrides)
        print(plan(cfg, validate(cfg, for_launch=False)))  # the shape, not the weights: LoRA plans without a base
    except ConfigError as err:
        fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in err.problems))
    except UntrustedTargetError as err:  # model.init_from's run names code outside plait: nothing of it was built
        fail(str(err))
    except Exception as err:  # noqa: BLE001 - Hydra's override errors: one line, like a run
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            fail(str(err).strip().splitlines()[0])
        raise
    sys.stdout.flush()
