"""The measures the learning tier reads off a run (`Result`: its evaluations, last training row,
first steps, and a driver's report) and the checks that hold them to thresholds (`at_least`,
`at_most`). The entries and their thresholds are tests/learns/entries.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Result = dict[str, Any]


# ------------------------------------------------------------------------------------------ measures
def final_val(key: str) -> Callable[[Result], float]:
    """``key`` (a ``val/...`` column of metrics.csv) at the run's last evaluation."""

    def read(result: Result) -> float:
        return result["evals"][-1][key]

    read.__doc__ = f"{key}"
    return read


def val_change(key: str) -> Callable[[Result], float]:
    """``key`` at the run's last evaluation minus at its first (step 0)."""

    def read(result: Result) -> float:
        return result["evals"][-1][key] - result["evals"][0][key]

    read.__doc__ = f"change of {key}"
    return read


def kto_margin(result: Result) -> float:
    """change of val reward, desirable - undesirable rows

    KTO's rows are unpaired: no pairwise accuracy, the mean rewards of the two labels instead."""
    first, last = result["evals"][0], result["evals"][-1]
    return (last["val/rewards/chosen"] - last["val/rewards/rejected"]) - (
        first["val/rewards/chosen"] - first["val/rewards/rejected"]
    )


def bytes_sent(result: Result) -> float:
    """bytes each rank sent to the other islands"""
    return result["last_step"].get("comm/bytes_sent_total", 0.0)


def rest_legal_lines(result: Result) -> float:
    """change of held-out legal lines per greedy trace, round 0 to the guided round

    The lines a Countdown search trace holds before its first wrong one (trainer.rest.sos.verify):
    a short run writes the search's language before it solves problems. The change, not the value:
    a guided round that keeps no trace, or leaves the model as it was, ends where round 0 did."""
    rounds = result["rest"]["arms"]["guided"]
    return rounds[-1]["legal_lines"] - rounds[0]["legal_lines"]


def rest_solve_rate(result: Result) -> float:
    """change of the held-out solve rate at the largest budget, round 0 to the guided round"""
    rounds = result["rest"]["arms"]["guided"]
    budget = str(max(result["rest"]["budgets"]))
    return rounds[-1]["solve_rate"][budget] - rounds[0]["solve_rate"][budget]


def msft_final_loss(result: Result) -> float:
    """mean val loss of the sources at the search's result (msft.json)"""
    return -result["msft"]["final_mean"]


def merged_gain(result: Result) -> float:
    """merged model's gain over its base on both tasks, the smaller, in units of each arm's

    On copy SFT: (held-out loss of the base - the merged) / (the base - the SFT arm); on copy pairs:
    (held-out reward accuracy of the merged against the base - 0.5) / (the DPO arm's - 0.5)."""
    return min(result["merge"]["sft_gain"], result["merge"]["dpo_gain"])


@dataclass(frozen=True)
class Check:
    """One held-out check: ``measure(result)`` against ``threshold``."""

    measure: Callable[[Result], float]
    threshold: float
    lower_is_better: bool = False

    def passes(self, value: float) -> bool:
        return value <= self.threshold if self.lower_is_better else value >= self.threshold

    @property
    def describes(self) -> str:
        return (self.measure.__doc__ or self.measure.__name__).strip().split("\n")[0]


def at_least(measure: Callable[[Result], float], threshold: float) -> Check:
    return Check(measure, threshold)


def at_most(measure: Callable[[Result], float], threshold: float) -> Check:
    return Check(measure, threshold, lower_is_better=True)
