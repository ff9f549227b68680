"""mSFT controller: the pick of the earliest optimum, the patience rule, a bitwise roll-back with a
source removed, and a whole search on two tiny synthetic sources."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from harness import TINY, compose_config
from hydra.utils import instantiate
from typing_extensions import override

from trainer.budget.msft import MSFT, best_steps, fit_run, loader_state, pick_earliest, settled
from trainer.data.base import DataError

EVALS = [
    (0, {"a": 0.1, "b": 0.0}),
    (10, {"a": 0.5, "b": 0.2}),
    (20, {"a": 0.4, "b": 0.3}),
    (30, {"a": 0.5, "b": 0.6}),
    (40, {"a": 0.2, "b": 0.5}),
]


def test_earliest_optimum_is_picked_and_ties_keep_the_first_step():
    best = best_steps(EVALS, ["a", "b"])
    assert best == {"a": (10, 0.5), "b": (30, 0.6)}  # a's later 0.5 does not move its optimum
    assert pick_earliest(best, ["a", "b"]) == "a"


def test_patience_settles_only_when_no_later_evaluation_can_change_the_pick():
    assert settled(EVALS[:2], ["a", "b"], patience=1) is None  # a's best is the last evaluation
    assert settled(EVALS[:3], ["a", "b"], patience=1) == "a"  # a settled at 10; b's best so far 20 >= 10
    assert settled(EVALS[:3], ["a", "b"], patience=2) is None


def test_a_removed_source_does_not_end_a_roll_out(tmp_path):
    """Roll-out 2 of a search: addition was removed at step 10, sorting is active. Addition's held-out
    score falls after its removal (forgetting), so its optimum is the start; sorting still improves.
    Only the active source's pick can end the roll-out: it must not stop after ``patience`` evaluations."""
    removed = {"addition": {"max_tokens": 100, "max_epochs": None}, "sorting": {"max_tokens": None, "max_epochs": 3.0}}
    cfg = MSFT(compute=2.0, eval_every=2, patience=2).rollout_config(
        _cfg(["data.sources.addition.metric=loss", "data.sources.sorting.metric=loss"]),
        tmp_path,
        removed,
        since=10,
        start={"addition": -1.0, "sorting": -3.0},
        active=["sorting"],
    )
    stop = instantiate(cfg.callbacks.settled)
    trainer, module = SimpleNamespace(should_stop=False), SimpleNamespace(history=[])
    for step, addition, sorting in ((12, 1.5, 2.9), (14, 2.0, 2.8), (16, 2.5, 2.7)):  # held-out losses
        module.history.append({"step": step, "metrics": {"val/loss/addition": addition, "val/loss/sorting": sorting}})
        stop.on_train_batch_end(trainer, module)
        assert not trainer.should_stop, f"stopped at step {step} by the removed source"
    for step in (18, 20):  # sorting's best (step 16) is now 2 evaluations old: settled
        module.history.append({"step": step, "metrics": {"val/loss/addition": 3.0, "val/loss/sorting": 2.75}})
        stop.on_train_batch_end(trainer, module)
    assert trainer.should_stop
    assert (
        stop.stop_reason == "budget.patience=2: the earliest optimum, sorting's at step 16, is settled"
    )  # summary.json's


def _cfg(extra=()):
    overrides = [o for o in TINY if not o.startswith(("data.eval_rows=", "data.seq_len=", "trainer.max_steps="))]
    return compose_config(
        [
            *overrides,
            "data=synthetic",
            "data.sources.addition.limit=24",
            "data.sources.addition.val_size=4",
            "data.sources.sorting.limit=24",
            "data.sources.sorting.val_size=4",
            "~data.sources.reversal",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            *extra,
        ],
        recipe="sft",
        tiny=False,
    )


class StateProbe(L.Callback):
    """Records weights, optimizer state, LR-scheduler state and the loader state at step ``at``
    (after that step) or when a fit starts from a checkpoint at that step."""

    def __init__(self, at: int) -> None:
        self.at = at

    def _record(self, trainer: L.Trainer, pl_module: Any, when: str) -> None:
        optimizer = trainer.strategy._unwrapped_optimizers()[0]
        state = {
            "params": {n: p.detach().clone() for n, p in pl_module.model.named_parameters()},
            "optim": {
                n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in pl_module.model.named_parameters()
            },
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
        }
        pl_module.history.append({"probe": when, **state})

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.at:
            self._record(trainer, pl_module, "saved")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_step == self.at:
            self._record(trainer, pl_module, "restored")


def test_roll_back_restores_weights_and_optimizer_state_bitwise(tmp_path):
    controller = MSFT(compute=1.0, eval_every=2)
    cfg = _cfg(["+callbacks.probe._target_=test_msft.StateProbe", "+callbacks.probe.at=2"])
    both = {n: {"max_tokens": None, "max_epochs": 1.0} for n in ("sorting", "addition")}
    history = fit_run(controller.rollout_config(cfg, tmp_path / "r0", both, 0), tmp_path / "r0")
    (saved,) = [h for h in history if h.get("probe") == "saved"]
    checkpoint = tmp_path / "r0" / "checkpoints" / "step_0000002"
    mixture = loader_state(checkpoint)["packer"]["mixture"]
    # Roll back to step 2 and remove "sorting": the same restore the search does.
    budgets = {
        "sorting": {"max_tokens": mixture["sorting"]["consumed"], "max_epochs": None},
        "addition": {"max_tokens": None, "max_epochs": 1.0},
    }
    history = fit_run(
        controller.rollout_config(cfg, tmp_path / "r1", budgets, 2), tmp_path / "r1", ckpt_path=str(checkpoint)
    )
    (restored,) = [h for h in history if h.get("probe") == "restored"]
    for name, value in saved["params"].items():
        assert torch.equal(restored["params"][name], value), name
    for name, state in saved["optim"].items():
        assert state.keys() == restored["optim"][name].keys()
        assert all(torch.equal(restored["optim"][name][k], v) for k, v in state.items()), name
    assert restored["sched"] == saved["sched"] == 2
    final = loader_state(tmp_path / "r1" / "checkpoints" / "last")
    assert final["tokens"]["sorting"] <= mixture["sorting"]["consumed"] + 64  # no sorting sample after the roll-back
    assert final["packer"]["mixture"]["sorting"] == mixture["sorting"]
    # A roll-out's checkpoint (the report's model) is a run's: plait generate / export build it from
    # the directory's config.yaml and tokenizer.json (missing before: roll-outs were built bare).
    from trainer.run_model import load_run_model

    rolled = load_run_model(checkpoint)
    assert rolled.tokenizer is not None and rolled.config.model == cfg.model


@pytest.mark.slow
def test_search_removes_every_source_once(tmp_path):
    report = MSFT(compute=1.0, eval_every=2, baseline=True).run(_cfg(), tmp_path)
    assert sorted(report["sources"]) == ["addition", "sorting"]
    assert len(report["rollouts"]) == 2 and report["flops"] > 0
    assert report["uniform"]["flops"] > 0 and (tmp_path / "msft.png").exists()


class RecordingSearch:
    """A ``budget`` node's object that records the run directory it was handed."""

    def run(self, cfg: Any, run_dir: Any) -> dict[str, Any]:
        return {"run_dir": str(run_dir), "sources": sorted(cfg.data.sources)}


def test_the_budget_driver_prepares_the_data_then_hands_the_run_directory_to_the_search(tmp_path):
    """`trainer.budget.driver.run_search`: the data is prepared and described on the launching
    rank (its roll-outs fork), then ``cfg.budget``'s ``run`` gets the run directory."""
    from trainer.budget.driver import is_search, run_search
    from trainer.config import validate

    cfg = _cfg(["+budget._target_=test_msft.RecordingSearch"])
    assert is_search(cfg) and not is_search(_cfg())
    said: list[str] = []
    report = run_search(cfg, tmp_path, validate(cfg), say=said.append)
    assert report == {"run_dir": str(tmp_path), "sources": ["addition", "sorting"]}
    assert said and said[0].startswith("data: 48 training samples")  # trainer.data.summary.describe, 2 x 24 rows


def test_a_search_on_data_without_sources_and_a_bad_setting_are_refused_by_validate() -> None:
    """plait pretrain +budget=msft printed the search's launch line and crashed with an
    AttributeError ('TextDataModule' has no 'names'); budget.compute=0 was a raw Hydra error."""
    from trainer.compose import compose
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"budget=msft searches per-source budgets of SFT data .* TextDataModule"):
        validate(compose("pretrain", ["model=nano", "+budget=msft"]))
    with pytest.raises(ConfigError, match=r"budget.compute=0 must be > 0"):
        validate(compose("sft", ["model=nano", "data=synthetic", "budget=msft", "budget.compute=0"]))


def test_the_table_names_the_searchs_model_or_that_there_is_none() -> None:
    """msft.json's checkpoint was the only place naming the result, and null was said nowhere."""
    from trainer.budget.report import table

    report = {
        "sources": {"a": {"step": 4, "epochs": 1.0, "tokens": 100}},
        "final_scores": {"a": 1.5},
        "final_mean": 1.5,
        "flops": 1e9,
        "trained_steps": 4,
        "checkpoint": "runs/m/rollout_0/checkpoints/step_0000004",
    }
    assert table(report).splitlines()[-1].startswith("mSFT's model: runs/m/rollout_0/checkpoints/step_0000004 (")
    assert table({**report, "checkpoint": None}).splitlines()[-1].startswith("mSFT's model: none: every source")


def test_a_search_inside_rest_is_refused() -> None:
    from trainer.compose import compose
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match="budget=msft and plait rest each drive runs of their own"):
        validate(compose("rest", ["+budget=msft"]))


def test_a_source_without_held_out_rows_is_refused_before_any_rollout(tmp_path) -> None:
    """Before: a source whose rows are copies of one (none held out) trained a whole roll-out, then
    the search died on a KeyError for its missing val/loss (a reviewer's repro)."""
    (tmp_path / "b.jsonl").write_text('{"prompt": "say hi", "completion": "hi"}\n' * 30)
    rows = "".join(f'{{"prompt": "what is {i}+{i}?", "completion": "{2 * i}"}}\n' for i in range(60))
    (tmp_path / "a.jsonl").write_text(rows)
    sources = f"data.sources={{a: {{source: {tmp_path / 'a.jsonl'}, val_size: 4}}, b: {{source: {tmp_path / 'b.jsonl'}, val_size: 4}}}}"
    cfg = compose_config(["model=nano", sources, "data.seq_len=64", "budget=msft"], recipe="sft", tiny=False)
    with pytest.raises(DataError, match=r"budget=msft scores every source on its held-out rows, and b has none"):
        instantiate(cfg.budget).search(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
