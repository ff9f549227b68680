"""``plait data [RECIPE] overrides [n=K]``: the training data as the model will see it, before any run.

The recipe is composed exactly as for a run (same recipe, same overrides) and its data module is
prepared as a run prepares it (`trainer.build.prepared_data`: same sources, tokenizer, chat
template, cuts and cache). Then, per source, the first K samples in the order the run trains
them: the decoded text after the chat template and tokenization, with the supervised tokens
(labels != -100: where the loss is taken) marked «like this» (green on a terminal); preference
pairs show their chosen and rejected rows. Last, what one pass trains of each source (samples,
tokens, supervised tokens) and what preparation cut (rows dropped, truncated, supervised tokens
lost) with the setting that keeps it. Nothing is trained and no run directory is written (the
prepared data is cached, so the run that follows starts from it). axolotl's ``preprocess --debug``
is the model.

Invocations::

    plait data sft data=synthetic n=3
    plait data sft 'data.sources={mine: {source: mine.jsonl}}' n=5
    plait data dpo n=2
    plait data pretrain n=1 count=false     # stop reading once each source has its n samples

Arguments besides the recipe and its overrides: ``n=K`` samples per source (default 3);
``count=false`` skips reading the whole pass for the counts (a large ``data=stream`` file).
"""

from __future__ import annotations

import os
import sys

from trainer.build import prepared_data
from trainer.compose import compose, fail, split_recipe
from trainer.config import ConfigError, validate
from trainer.data.base import DataError
from trainer.data.chat import ChatError
from trainer.data.preview import COLOR, PLAIN, preview_lines
from trainer.targets import UntrustedTargetError

OPTIONS = {"n": "3", "count": "true"}  # plait data's own arguments, taken out before Hydra composes


def options(argv: list[str]) -> tuple[int, bool, list[str]]:
    """(``n``, ``count``, the recipe and its overrides).

    Raises:
        SystemExit: (exit 2, ``plait: error:``) ``n`` is not a whole number >= 1, or ``count`` not true/false.
    """
    given, rest = dict(OPTIONS), []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in OPTIONS:
            given[key] = value
        else:
            rest.append(arg)
    if not given["n"].isdigit() or int(given["n"]) < 1:
        fail(f"n={given['n']} must be a whole number >= 1 (samples per source), e.g. n=3")
    if given["count"] not in ("true", "false"):
        fail(f"count={given['count']} must be true or false")
    return int(given["n"]), given["count"] == "true", rest


def main(argv: list[str]) -> None:
    """Entry of ``plait data``: compose like a run, prepare the data, print; exit 2 on bad input."""
    n, count, rest = options(argv)
    recipe, overrides = split_recipe(rest)

    style = COLOR if sys.stdout.isatty() and not os.environ.get("NO_COLOR") else PLAIN
    try:
        cfg = compose(recipe, overrides)
        data = prepared_data(cfg, validate(cfg))
        lines = preview_lines(data, per_source=n, count=count, style=style)
    except ConfigError as err:
        fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in err.problems))
    except (DataError, ChatError, UntrustedTargetError) as err:
        fail(str(err))
    except Exception as err:  # Hydra's override errors: one line, like a run
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            fail(str(err).strip().splitlines()[0])
        raise
    print("\n".join(lines))
    sys.stdout.flush()
