"""The mSFT report: a side-by-side table and a plot of every source's held-out curve and stopping point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.figures import pyplot


def table(report: dict[str, Any]) -> str:
    """mSFT's per-source stopping points and final scores, next to the best uniform baseline."""
    lines = [f"{'source':<24} {'stop step':>9} {'epochs':>7} {'tokens':>9} {'msft score':>10} {'uniform':>8}"]
    uniform = report.get("uniform", {}).get("scores", {})
    for name, stop in report["sources"].items():
        u = uniform.get(name)
        lines.append(
            f"{name:<24} {stop['step']:>9} {stop['epochs']:>7.2f} {stop['tokens']:>9} "
            f"{report['final_scores'][name]:>10.4f} {'' if u is None else f'{u:.4f}':>8}"
        )
    lines.append(
        f"mSFT: mean score {report['final_mean']:.4f}, training FLOPs {report['flops']:.3e} ({report['trained_steps']} steps)"
    )
    ckpt = report.get("checkpoint")
    lines.append(
        f"mSFT's model: {ckpt} (model.init_from= it, or plait generate ckpt= it)"
        if ckpt
        else "mSFT's model: none: every source scored best at step 0, before any training (the model as it "
        "started); more compute (budget.compute) or data may let a source learn"
    )
    if "uniform" in report:
        u = report["uniform"]
        lines.append(
            f"uniform: best mean score {u['best_mean']:.4f} at step {u['best_step']} of {u['steps']}, "
            f"training FLOPs {u['flops']:.3e}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Each source's score over global steps in every roll-out, with its stopping point marked."""
    plt = pyplot()
    names = list(report["sources"])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for k, rollout in enumerate(report["rollouts"]):
            points = [(step, s[name]) for step, s in rollout["curve"] if name in s]
            if points:
                ax.plot(*zip(*points), marker=".", label=f"roll-out {k}", alpha=0.8)
        stop = report["sources"][name]
        ax.axvline(stop["step"], color="k", linestyle="--", linewidth=1)
        ax.scatter([stop["step"]], [stop["score"]], color="k", zorder=5, label="stop")
        if "uniform" in report:
            points = [(step, s[name]) for step, s in report["uniform"]["curve"] if name in s]
            ax.plot(*zip(*points), color="gray", linewidth=0.8, linestyle=":", label="uniform")
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
    axes[0][0].set_ylabel("held-out score")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
