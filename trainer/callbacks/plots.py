"""``loss.png``: training and validation loss against optimizer steps (and, for an online RL run,
the mean reward of its rollouts and of the held-out prompts, on a second axis)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from typing_extensions import override

from trainer.figures import pyplot
from trainer.rundir import RunDir


def plot_losses(history: list[dict[str, float]], path: Path, title: str = "") -> None:
    """Writes a PNG of train loss (per step) and validation loss (per evaluation) from a Task history."""
    plt = pyplot()
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    val = [(h["step"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.0)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    rewards = [(h["step"], h["train/reward"]) for h in history if isinstance(h.get("train/reward"), float)]
    val_rewards = [(h["step"], h["metrics"]["val/reward"]) for h in history if "val/reward" in h.get("metrics", {})]
    if rewards or val_rewards:
        right = ax.twinx()
        if rewards:
            right.plot(*zip(*rewards), color="tab:green", label="train reward", linewidth=1.0)
        if val_rewards:
            right.plot(*zip(*val_rewards), "s-", color="tab:red", label="held-out reward (greedy)", markersize=3)
        right.set_ylabel("mean reward")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class LossPlot(L.Callback):
    """Writes ``<dirpath>/loss.png`` at the end of training (rank 0).

    Args:
        dirpath: the run directory (the trainer sets it).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = Path(dirpath) if dirpath else None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.dirpath is not None:
            plot_losses(pl_module.history, RunDir(self.dirpath).loss_plot, title=self.dirpath.name)
