"""mSFT: search each source's training budget by roll-out and roll-back (``plait sft budget=msft``).

Implements the loop of "mSFT: dataset-mixture overfitting in multi-task SFT" (Koh, Jeon, ... Yun):

1. all sources active; 2. **roll out**: train the active mixture ``compute`` more epochs of each
active source, checkpointing and scoring every source's held-out metric every ``eval_every``
steps; 3. the source whose best score comes **earliest** is picked; 4. **roll back** to that
checkpoint (model, optimizer, scheduler, RNG and mixture state: a plain resume), remove the source
(its ``max_tokens`` becomes what it had consumed there, so the restored mixture never draws it
again) and 5. repeat from there until no source is left. The model at the last roll-back point is
the result.

Each roll-out is an ordinary plait run (``<run_dir>/rollout_<k>``) fitted in a forked process on
one device, so the search needs no process group of its own. Scores: ``exact_match`` sources are
scored by held-out exact match, ``loss`` sources by minus their validation loss. FLOPs count the
training tokens of every roll-out, including the steps discarded by roll-backs (evaluation is
not counted). ``patience`` (not in the paper) ends a roll-out early once the earliest optimum is
known: an active source whose best score is ``patience`` evaluations old is settled, and once the
earliest settled optimum comes no later than every unsettled active source's best so far, no
later evaluation can change the pick (removed sources never count: they are not picked from).

The uniform baseline trains every source ``compute`` epochs in one run (the first roll-out,
when it ran in full) and takes its best checkpoint by mean score: the best uniform epoch count.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import lightning as L
from omegaconf import DictConfig, OmegaConf, open_dict
from typing_extensions import override

from strategies.checkpoint.dcp import META_FILE
from strategies.checkpoint.safe_load import load_plain
from strategies.core.model_contract import flops_per_token
from strategies.core.ranges import POSITIVE
from strategies.runtime.launch import LAUNCH_ENV
from trainer.budget.report import plot, table
from trainer.build import build_data, build_fit, build_model, prepared_data
from trainer.config import validate
from trainer.data.base import DataError
from trainer.data.sft import SFTDataModule
from trainer.resume_record import ResumeRecord
from trainer.rundir import RunDir

Scores = dict[str, float]


def scores_of(metrics: dict[str, float], metric_of: dict[str, str]) -> Scores:
    """Per-source score (higher is better) from one evaluation's metrics."""
    out = {}
    for name, metric in metric_of.items():
        key = f"val/exact_match/{name}" if metric == "exact_match" else f"val/loss/{name}"
        if key in metrics:
            out[name] = metrics[key] if metric == "exact_match" else -metrics[key]
    return out


def evaluations(
    history: list[dict[str, Any]], metric_of: dict[str, str], *, since: int = 0
) -> list[tuple[int, Scores]]:
    """``(step, scores)`` of every evaluation at or after step ``since``, in step order (the last wins)."""
    by_step = {h["step"]: scores_of(h["metrics"], metric_of) for h in history if "metrics" in h and h["step"] >= since}
    return sorted(by_step.items())


def best_steps(evals: list[tuple[int, Scores]], names: list[str]) -> dict[str, tuple[int, float]]:
    """Each source's earliest best ``(step, score)``."""
    best: dict[str, tuple[int, float]] = {}
    for step, scores in evals:
        for name in names:
            if name in scores and (name not in best or scores[name] > best[name][1]):
                best[name] = (step, scores[name])
    return best


def pick_earliest(best: dict[str, tuple[int, float]], names: list[str]) -> str:
    """The source whose optimum comes first; ties go to the source listed first."""
    return min(names, key=lambda n: (best[n][0], names.index(n)))


def settled(evals: list[tuple[int, Scores]], names: list[str], patience: int) -> str | None:
    """With ``patience`` evaluations, the source whose optimum is provably the earliest, or None."""
    if not evals:
        return None
    best = best_steps(evals, names)
    steps = [s for s, _ in evals]
    is_settled = {n: steps.index(best[n][0]) + patience < len(steps) for n in names if n in best}
    done = [n for n in names if is_settled.get(n)]
    if not done:
        return None
    first = pick_earliest(best, done)
    open_bests = [best[n][0] for n in names if not is_settled.get(n)]
    return first if all(best[first][0] <= s for s in open_bests) else None


class SettledStop(L.Callback):
    """Stops a roll-out once `settled` names the earliest optimum (``patience`` set); its
    ``stop_reason`` then says so (the roll-out's ``summary.json``)."""

    def __init__(
        self, metric_of: dict[str, str], patience: int, since: int, start: dict[str, float] | None = None
    ) -> None:
        self.metric_of, self.patience, self.since = dict(metric_of), patience, since
        self.start = [(since, dict(start))] if start else []
        self.stop_reason: str | None = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        evals = self.start + evaluations(pl_module.history, self.metric_of, since=self.since + bool(self.start))
        name = settled(evals, list(self.metric_of), self.patience)
        if name is not None:
            trainer.should_stop = True
            step = best_steps(evals, [name])[name][0]
            self.stop_reason = (
                f"budget.patience={self.patience}: the earliest optimum, {name}'s at step {step}, is settled"
            )


def fit_run(cfg: DictConfig, run_dir: Path, *, ckpt_path: str | None = None) -> list[dict[str, Any]]:
    """Builds and fits ``cfg`` in a forked process; returns the Task's history. The run directory
    gets its ``config.yaml`` and tokenizer as a launched run's (`trainer.resume_record.ResumeRecord`), so
    the report's model (a roll-out's checkpoint) serves ``plait generate``, ``export`` and ``eval``."""
    run = validate(cfg)
    data = prepared_data(cfg, run)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = ResumeRecord(
        cfg, data.tokenizer, run_dir, {}, data.model_chat_template(), data_fingerprint=data.data_fingerprint()
    )
    trainer, task = build_fit(cfg, run, run_dir, data, launcher="fork", callbacks=[record])
    try:
        trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
    return task.history


def loader_state(checkpoint: Path) -> dict[str, Any]:
    """The mixture loader's saved state (trained position, per-source tokens) of a checkpoint."""
    meta = load_plain(Path(checkpoint) / META_FILE)
    return meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]


class MSFT:
    """The mSFT controller (see module docstring).

    Args:
        compute: C, epochs of the active sources per roll-out.
        eval_every: optimizer steps between scored checkpoints.
        patience: None for full roll-outs; k to end a roll-out once its pick is settled.
        baseline: also report the uniform-epochs baseline under the same compute.
    """

    def __init__(
        self,
        *,
        compute: Annotated[float, POSITIVE] = 3.0,
        eval_every: Annotated[int, POSITIVE] = 10,
        patience: Annotated[int, POSITIVE] | None = None,
        baseline: bool = True,
    ) -> None:
        if compute <= 0 or eval_every <= 0 or (patience is not None and patience < 1):
            raise ValueError("budget.compute and budget.eval_every must be positive, budget.patience >= 1 or null")
        self.compute, self.eval_every, self.patience, self.baseline = compute, eval_every, patience, baseline

    @staticmethod
    def data_problems(data_cls: type) -> list[str]:
        """What keeps ``data_cls`` (the data node's class) from a budget search: mSFT searches the
        per-source budgets of SFT data (`trainer.data.sft.SFTDataModule`'s ``data.sources``)."""
        if issubclass(data_cls, SFTDataModule):
            return []
        return [
            f"budget=msft searches per-source budgets of SFT data (data.sources), but the data is "
            f"{data_cls.__name__}; use plait sft (data=sft or data=synthetic) with budget=msft"
        ]

    # ------------------------------------------------------------------------------ configs
    def rollout_config(
        self,
        cfg: DictConfig,
        run_dir: Path,
        budgets: dict[str, dict[str, Any]],
        since: int,
        start: Scores | None = None,
        active: list[str] | None = None,
    ) -> DictConfig:
        """``cfg`` for one roll-out: the given source budgets, scored checkpoints every ``eval_every``.

        ``active`` (None: every source): the sources the roll-out picks from; with ``patience`` only
        they can end it (a removed source's held-out loss usually rises after its removal, so its
        optimum is the roll-out's start and would settle the roll-out after ``patience``
        evaluations, before any active source's pick is known)."""
        out = copy.deepcopy(cfg)
        with open_dict(out):
            out.budget, out.resume, out.run_dir = None, None, str(run_dir)
            out.train.eval_every = self.eval_every
            out.trainer.max_steps = 10**9  # the budgets end the roll-out
            out.callbacks.checkpoint.every_n_steps = self.eval_every
            out.callbacks.checkpoint.keep_last = 0
            for name, budget in budgets.items():
                out.data.sources[name].max_tokens = budget["max_tokens"]
                out.data.sources[name].max_epochs = budget["max_epochs"]
            if self.patience is not None and since >= 0:
                metric_of = {n: m for n, m in self._metric_of(cfg).items() if active is None or n in active}
                start = {n: v for n, v in start.items() if n in metric_of} if start else None
                out.callbacks.settled = {
                    "_target_": f"{__name__}.SettledStop",
                    "metric_of": metric_of,
                    "patience": self.patience,
                    "since": since,
                    "start": start,
                }
        return out

    @staticmethod
    def _metric_of(cfg: DictConfig) -> dict[str, str]:
        return {str(n): (s.get("metric") or "loss") for n, s in cfg.data.sources.items()}

    # ------------------------------------------------------------------------------ the search
    def search(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        """Runs the roll-out / roll-back loop; returns the report (also ``<run_dir>/msft.json``)."""
        data = build_data(cfg)
        sizes = {n: len(data.prepare().train[n]) for n in data.names}
        if unscored := [n for n in data.names if not len(data.prepare().val[n])]:
            raise DataError(
                f"budget=msft scores every source on its held-out rows, and {', '.join(unscored)} has none "
                "(its val_size is 0, or its rows are copies of one); set data.sources.<name>.val_size, give it "
                "distinct rows, or leave it out of data.sources"
            )
        metric_of, names = self._metric_of(cfg), list(data.names)
        active, removed = list(names), {}
        ckpt: Path | None = None
        start_step, start_scores, rollouts = 0, None, []
        tokens_per_step = cfg.train.global_batch_size * data.seq_len
        while active:
            k = len(rollouts)
            state = loader_state(ckpt) if ckpt else None
            mixture = state["packer"]["mixture"] if state else {}
            budgets = {}
            for n in names:
                done = mixture.get(n, {}).get("emitted", 0) / sizes[n]
                if n in removed:  # removed before any training (ckpt None): 0 tokens
                    budgets[n] = {"max_tokens": mixture.get(n, {}).get("consumed", 0), "max_epochs": None}
                else:
                    budgets[n] = {"max_tokens": None, "max_epochs": done + self.compute}
            rollout_dir = run_dir / f"rollout_{k}"
            rollout_cfg = self.rollout_config(cfg, rollout_dir, budgets, start_step, start_scores, active)
            history = fit_run(rollout_cfg, rollout_dir, ckpt_path=str(ckpt) if ckpt else None)
            evals = evaluations(history, metric_of, since=start_step + (start_scores is not None))
            if start_scores is not None:
                evals = [(start_step, start_scores)] + evals
            last_step = max(h["step"] for h in history if "loss" in h)
            best = best_steps(evals, active)
            chosen = pick_earliest(best, active)
            stop_step = best[chosen][0]
            if stop_step != start_step:  # else the roll-back point is where this roll-out started
                ckpt = RunDir(rollout_dir).step(stop_step)
            stop = loader_state(ckpt) if ckpt else {"tokens": {}, "packer": {"mixture": {}}}
            removed[chosen] = {
                "rollout": k,
                "step": stop_step,
                "score": best[chosen][1],
                "tokens": stop["tokens"].get(chosen, 0),
                "epochs": stop["packer"]["mixture"].get(chosen, {}).get("emitted", 0) / sizes[chosen],
            }
            rollouts.append(
                {"start": start_step, "end": last_step, "active": list(active), "removed": chosen, "curve": evals}
            )
            start_step, start_scores = stop_step, dict(evals)[stop_step]
            active.remove(chosen)
        flops_per_token = self._flops_per_token(cfg, data)
        trained_steps = sum(r["end"] - r["start"] for r in rollouts)
        return {
            "sources": removed,
            "final_step": start_step,
            "final_scores": start_scores,
            "final_mean": sum(start_scores.values()) / len(start_scores),
            "flops": trained_steps * tokens_per_step * flops_per_token,
            "trained_steps": trained_steps,
            "rollouts": rollouts,
            "checkpoint": str(ckpt) if ckpt else None,
        }

    def uniform(self, cfg: DictConfig, run_dir: Path, first_rollout: dict[str, Any] | None) -> dict[str, Any]:
        """The best uniform epoch count under ``compute`` epochs: the first roll-out when it ran in
        full (same run), else one run of its own."""
        data = build_data(cfg)
        metric_of = self._metric_of(cfg)
        if first_rollout is not None and self.patience is None:
            evals, end = first_rollout["curve"], first_rollout["end"]
        else:
            budgets = {n: {"max_tokens": None, "max_epochs": self.compute} for n in data.names}
            history = fit_run(self.rollout_config(cfg, run_dir / "uniform", budgets, -1), run_dir / "uniform")
            evals = evaluations(history, metric_of)
            end = max(h["step"] for h in history if "loss" in h)
        means = [(step, sum(s.values()) / len(s)) for step, s in evals]
        best_step, best_mean = max(means, key=lambda x: (x[1], -x[0]))
        flops = end * cfg.train.global_batch_size * data.seq_len * self._flops_per_token(cfg, data)
        return {
            "best_step": best_step,
            "best_mean": best_mean,
            "scores": dict(evals)[best_step],
            "flops": flops,
            "steps": end,
            "curve": evals,
        }

    @staticmethod
    def _flops_per_token(cfg: DictConfig, data: Any) -> float:
        model = build_model(cfg, validate(cfg), vocab_size=data.tokenizer.vocab_size)
        return flops_per_token(model, data.seq_len)

    def length_line(self, cfg: DictConfig) -> str:
        """What ends each roll-out, said at launch: the budgets, not ``trainer.max_steps``."""
        patience = f", or until budget.patience={self.patience} evaluations settle its pick" if self.patience else ""
        return (
            f"budget=msft: each roll-out trains the active sources budget.compute={self.compute:g} more epochs{patience}; "
            f"trainer.max_steps={cfg.trainer.max_steps} does not apply (each roll-out's summary.json says what ended it)"
        )

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        """Search, baseline, ``msft.json``, ``msft.png`` and a printed table."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"plait: {self.length_line(cfg)}", file=sys.stderr)
        report = self.search(cfg, run_dir)
        if self.baseline:
            report["uniform"] = self.uniform(cfg, run_dir, report["rollouts"][0])
        (run_dir / "msft.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
        plot(report, run_dir / "msft.png")
        print(table(report))
        OmegaConf.save(cfg, RunDir(run_dir).config, resolve=True)
        return report
