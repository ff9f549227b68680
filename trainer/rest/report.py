"""The ReST report: held-out solve rate against round and against the generation budget, per arm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.figures import pyplot


def table(report: dict[str, Any]) -> str:
    """One line per arm and round: the round's data and the held-out solve rate at every budget."""
    budgets = [str(b) for b in report["budgets"]]
    head = (
        f"{'arm':<9} {'round':>5} {'sampled':>7} {'solved':>7} {'kept':>6} {'train tok':>9} {'valid':>6} {'lines':>6} "
        + " ".join(f"{'@' + b:>6}" for b in budgets)
    )
    lines = [head]
    for arm, entries in report["arms"].items():
        for e in entries:
            s = e["stats"]
            rates = " ".join(f"{e['solve_rate'][b]:>6.3f}" for b in budgets)
            lines.append(
                f"{arm:<9} {e['round']:>5} {s['sampled']:>7} {s['solved']:>7} {s['kept']:>6} {e['train_tokens']:>9} "
                f"{e['valid']:>6.3f} {e['legal_lines']:>6.1f} {rates}"
            )
    lines.append(
        f"held-out, greedy ({report['problems']['held_out']} problems): valid traces, legal lines before the first "
        "wrong one, solve rate within @N generated tokens"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Left: solve rate at the largest budget against round; right: solve rate against the
    generation budget at each arm's last round (and round 0)."""
    plt = pyplot()
    top = str(report["budgets"][-1])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for arm, entries in report["arms"].items():
        left.plot([e["round"] for e in entries], [e["solve_rate"][top] for e in entries], marker="o", label=arm)
        last = entries[-1]
        right.plot(
            report["budgets"],
            [last["solve_rate"][str(b)] for b in report["budgets"]],
            marker=".",
            label=f"{arm}, round {last['round']}",
        )
    first = next(iter(report["arms"].values()))[0]
    right.plot(
        report["budgets"],
        [first["solve_rate"][str(b)] for b in report["budgets"]],
        color="gray",
        linestyle=":",
        label="round 0",
    )
    left.set(xlabel="round", ylabel=f"held-out solve rate (@{top} tokens)")
    left.set_xticks(sorted({e["round"] for entries in report["arms"].values() for e in entries}))
    right.set(xlabel="generation budget (tokens)", ylabel="held-out solve rate")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
