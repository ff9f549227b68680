"""The table of plait's commands: ``plait [CMD] [RECIPE] k=v`` runs ``COMMANDS[CMD]`` (train by default).

Each command is a module with ``main(argv)`` (argv after the command's name), imported only when
it runs, so ``plait generate`` does not import the trainer, ``plait --help`` imports neither
Hydra nor torch (it reads `trainer.catalog`) and ``plait COMMAND --help`` reads the module's
docstring from its source (`module_docstring`). Commands share `trainer.compose` (recipes,
``compose``, the ``plait: error:`` exit) and `trainer.rundir` (a run directory's layout and its
model); none imports the CLI. A new command is one row here and one module.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.catalog import CONF_DIR, HELP_FLAGS, config_groups


@dataclass(frozen=True)
class Command:
    """One row of the table.

    Args:
        name: the word after ``plait``.
        module: the module whose ``main(argv)`` runs it (its docstring is the command's help).
        summary: one line for ``plait --help``.
        config: the file of ``conf/`` its ``key=value`` arguments override (None: it takes a recipe).
    """

    name: str
    module: str
    summary: str
    config: str | None = None

    def main(self, argv: list[str]) -> None:
        """Runs the command; ``--help`` prints `help` instead (train prints its recipe's own help)."""
        if self.name != "train" and any(a in HELP_FLAGS for a in argv):
            print(self.help())
            return
        importlib.import_module(self.module).main(argv)

    def help(self) -> str:
        """The module's docstring, then the command's options (its conf file) or the config groups."""
        doc = plain_text((module_docstring(self.module) or self.summary).strip())
        lines = [doc, ""]
        if self.config is not None:
            lines.append(f"Options (key=value; defaults from conf/{self.config}.yaml, ??? = required):")
            text = (CONF_DIR / f"{self.config}.yaml").read_text().splitlines()
            lines += [f"  {line}" for line in text if line.strip() and not line.startswith("#")]
        else:
            lines.append("Config groups (GROUP=OPTION; every field is also an override, e.g. optim.lr=1e-3):")
            lines += [f"  {group:<12} {', '.join(options)}" for group, options in config_groups().items()]
        return "\n".join(lines)


def plain_text(doc: str) -> str:
    """A docstring as a terminal shows it: without reStructuredText's marks (````code````, ```name```,
    a literal block's ``::``)."""
    doc = re.sub(r"``([^`]+)``", r"\1", doc)
    doc = re.sub(r"`([^`]+)`", r"\1", doc)
    return re.sub(r"::$", ":", doc, flags=re.MULTILINE)


def module_docstring(module: str) -> str | None:
    """The docstring of ``module``, read from its source: ``plait generate --help`` does not import
    the command (torch, Lightning: seconds) to print it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text()))


TRAIN = Command("train", "trainer.train", "train a recipe (the default: plait RECIPE ... is plait train RECIPE ...)")
COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        TRAIN,
        Command(
            "resume", "trainer.resume_run", "continue a run directory from its newest checkpoint, with its own config"
        ),
        Command("plan", "trainer.plan", "rank parallel layouts of a recipe for a cluster, without training"),
        Command(
            "data",
            "trainer.preview",
            "print a recipe's training samples as the model sees them, supervised tokens marked",
        ),
        Command("generate", "trainer.generate", "sample a continuation from a run's checkpoint", config="generate"),
        Command("chat", "trainer.chat", "talk to a run's model (its chat template, stdin/stdout)", config="chat"),
        Command(
            "export", "trainer.export", "write a run's checkpoint as a Hugging Face model directory", config="export"
        ),
        Command("merge", "trainer.merge", "merge fine-tuned runs' deltas into their base (PAFT)", config="merge"),
        Command("eval", "trainer.eval", "score a run's checkpoint on lm-evaluation-harness tasks", config="eval"),
        Command(
            "compare",
            "trainer.compare",
            "runs side by side: their differing config, summary and validation losses",
            config="compare",
        ),
    )
}


def dispatch(argv: Sequence[str]) -> tuple[Command, list[str]]:
    """(the command ``argv`` names, its arguments): ``argv[0]`` when it is a command, else train."""
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]], list(argv[1:])
    return TRAIN, list(argv)
