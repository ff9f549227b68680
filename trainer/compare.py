"""``plait compare RUN_OR_FOLDER ...``: runs side by side, a table and one plot of their validation losses.

Invocations::

    plait compare runs/pretrain/2026-12-01_20-14-19           # a --multirun folder: each job
    plait compare runs/pretrain/a runs/pretrain/b out=lr.png  # given runs

Each argument is a run directory (it has a ``config.yaml`` or ``metrics.csv``) or a folder
searched for them (a sweep's job folders, ``runs/pretrain``'s runs). The table has one row per
run: its name, the config fields in which the runs differ (what their overrides changed:
``optim.lr``, ``model.dim``, ...; the run directory, resume and loggers left out), and its
``summary.json``: steps, final validation and training loss, tokens per second, then what stopped
a run when any stopped before ``trainer.max_steps`` (``stopped by``), then each headline metric
of the last evaluation that any run has (``final_val_metrics``: ``rewards/accuracy`` and
``rewards/margin`` of a preference run, ``exact_match/<source>``; ``-`` for a run without it), then
the lm-eval scores of the run's newest ``eval/*.json`` (``plait eval``, ``callbacks.lm_eval``:
``<task>/<metric>``). The plot draws
each run's ``val/loss`` of ``metrics.csv`` against optimizer steps; it is written to ``out``
(default: ``compare.png`` in the folder the runs share).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainer.compose import compose_command, fail
from trainer.eval import newest_scores
from trainer.figures import pyplot

USAGE = "plait compare RUN_OR_FOLDER ... [out=compare.png]"
SUMMARY_COLUMNS = (
    ("steps", "steps"),
    ("final_val_loss", "val loss"),
    ("final_train_loss", "train loss"),
    ("tokens_per_s", "tokens/s"),
)
# Config keys that differ between runs without changing what they trained (where and how they log).
IGNORED_PREFIXES = ("run_dir", "resume", "logger")


def find_runs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The run directories ``paths`` name, in the order given (each folder's runs sorted by name).

    Raises:
        FileNotFoundError: a path that does not exist or holds no run.
    """
    runs: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a directory; give run directories or a folder of runs")
        found = sorted(
            {Path(root) for root, _, files in os.walk(path) if "config.yaml" in files or "metrics.csv" in files}
        )
        found = [p for p in found if not any(q != p and q in p.parents for q in found)]  # a run's hf/ is no run
        if not found:
            raise FileNotFoundError(f"{path} holds no run (no config.yaml or metrics.csv below it)")
        runs += [p for p in found if p not in runs]
    return runs


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def differing_fields(configs: Sequence[dict[str, Any]]) -> list[str]:
    """The dotted keys whose values are not the same in every config (a key one config lacks counts)."""
    flat = [_flat(c) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    missing = object()
    return [
        k for k in keys
        if not k.startswith(IGNORED_PREFIXES) and len({repr(f.get(k, missing)) for f in flat}) > 1
    ]  # fmt: skip


def val_losses(run: Path) -> list[tuple[int, float]]:
    """(step, val/loss) of every row of ``run/metrics.csv`` with a validation loss."""
    path = run / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("val/loss")]
    return [(int(float(row["step"])), float(row["val/loss"])) for row in rows]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if not math.isnan(value) else "nan"
    return "-" if value is None else str(value)


def _field_cell(flat: dict[str, Any], key: str) -> str:
    """A config field's cell: its value, ``null`` when set to null (a run without LoRA has
    ``strategy.lora: null``), ``on`` for a node the run sets (the same key is a mapping there: a
    LoRA run's ``strategy.lora``), ``-`` when the run's config lacks it."""
    if key in flat:
        return "null" if flat[key] is None else _cell(flat[key])
    return "on" if any(k.startswith(key + ".") for k in flat) else "-"


def measure_columns(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(dotted key into summary.json, title) of the columns beyond `SUMMARY_COLUMNS`: ``stopped by``
    when some run stopped before ``trainer.max_steps``, then every metric of the runs'
    ``final_val_metrics`` in the order first met (titled without ``val/``)."""
    stopped = any(s.get("stopped_by") not in (None, "max_steps") for s in summaries)
    columns = [("stopped_by", "stopped by")] if stopped else []
    names = list(dict.fromkeys(n for s in summaries for n in s.get("final_val_metrics") or {}))
    return columns + [(f"final_val_metrics.{n}", n.removeprefix("val/")) for n in names]


def _get(summary: dict[str, Any], key: str) -> Any:
    head, _, rest = key.partition(".")
    return (summary.get(head) or {}).get(rest) if rest else summary.get(head)


def table(runs: Sequence[Path]) -> str:
    """The comparison table: one row per run, the differing config fields, then the summary."""
    configs = [
        OmegaConf.to_container(OmegaConf.load(r / "config.yaml")) if (r / "config.yaml").is_file() else {} for r in runs
    ]
    fields = differing_fields(configs)
    summaries = [json.loads((r / "summary.json").read_text()) if (r / "summary.json").is_file() else {} for r in runs]
    root = Path(os.path.commonpath([r.resolve() for r in runs]))
    names = [str(r.resolve().relative_to(root)) if r.resolve() != root else r.name for r in runs]
    columns = [*SUMMARY_COLUMNS, *measure_columns(summaries)]
    scores = [newest_scores(r) for r in runs]
    evaluated = list(dict.fromkeys(name for s in scores for name in s))
    header = ["run", *fields, *(title for _, title in columns), *evaluated]
    rows = [
        [
            name,
            *(_field_cell(_flat(c), k) for k in fields),
            *(_cell(_get(s, key)) for key, _ in columns),
            *(_cell(e.get(k)) for k in evaluated),
        ]
        for name, c, s, e in zip(names, configs, summaries, scores)
    ]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def plot_val_losses(runs: Sequence[Path], labels: Sequence[str], out: Path) -> list[str]:
    """Writes a PNG of each run's validation loss against optimizer steps (one line per run).

    Returns:
        The labels of the runs drawn: a run without a validation loss (crashed before its first
        evaluation, or ``data.val_fraction=0``) has no line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    drawn = []
    for run, label in zip(runs, labels):
        points = val_losses(run)
        if points:
            ax.plot(*zip(*points), "o-", label=label, markersize=3)
            drawn.append(label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return drawn


def main(argv: list[str]) -> None:
    """Entry of ``plait compare``: run directories or folders, then ``key=value`` of conf/compare.yaml."""
    paths = [a for a in argv if "=" not in a]
    cfg = compose_command("compare", [a for a in argv if "=" in a], usage=USAGE)
    paths += list(cfg.runs or [])
    if not paths:
        fail(f"no run given (usage: {USAGE})")
    try:
        runs = find_runs(paths)
    except FileNotFoundError as err:
        fail(str(err))
    print(table(runs))
    root = Path(os.path.commonpath([r.resolve() for r in runs]))
    out = Path(cfg.out) if cfg.out else (root if root not in runs else root.parent) / "compare.png"
    labels = [str(r.resolve().relative_to(root)) if r.resolve() != root else r.name for r in runs]
    drawn = plot_val_losses(runs, labels, out)
    missing = [label for label in labels if label not in drawn]
    without = f"; no validation loss in {', '.join(missing)}" if missing else ""
    print(f"plait: wrote {out} (validation loss of {len(drawn)} run{'s' * (len(drawn) != 1)}{without})")
