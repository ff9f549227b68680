"""The golden curves' rules (`learns.golden.golden_verdict`, `update_golden`) on made-up results: an
entry from a base is compared with the variant its base's end state gave, and never passes a
changed curve. (No training: these run in the default suite's first seconds.)"""

from __future__ import annotations

import json

import pytest

from learns import golden as tier

CURVE = {"train/loss": [1.0, 0.9, 0.8]}
MOVED = {"train/loss": [1.0, 0.9, 0.81]}


def _results(base_val_loss: float, curve: dict) -> dict:
    return {"sft": {"evals": [{"val/loss": base_val_loss}], "curve": CURVE}, "dpo": {"evals": [], "curve": curve}}


@pytest.fixture
def golden(tmp_path, monkeypatch):
    path = tmp_path / "golden.json"
    monkeypatch.setattr(tier, "GOLDEN", path)
    path.write_text(json.dumps({"sft": CURVE, "dpo": [{"base_val_loss": 1.25, "curve": CURVE}]}))
    return path


def test_a_curve_from_the_same_base_must_not_move(golden) -> None:
    assert tier.golden_verdict("dpo", _results(1.25, CURVE))[0] == "ok"
    verdict, why = tier.golden_verdict("dpo", _results(1.25, MOVED))
    assert verdict == "moved" and "step 3 stored 0.8 now 0.81" in why


def test_an_unseen_base_is_named_not_passed(golden) -> None:
    verdict, why = tier.golden_verdict("dpo", _results(1.5, MOVED))
    assert verdict == "unseen base" and "val/loss 1.5" in why and "--update-golden" in why
    # Any stored curve it equals passes, whatever its base's end state.
    assert tier.golden_verdict("dpo", _results(1.5, CURVE))[0] == "ok"


def test_an_entry_from_scratch_has_one_curve(golden) -> None:
    results = _results(1.25, CURVE)
    results["sft"]["curve"] = MOVED
    assert tier.golden_verdict("sft", results)[0] == "moved"


def test_update_adds_a_new_base_and_drops_stale_variants_on_a_move(golden, monkeypatch) -> None:
    monkeypatch.setattr(tier, "passed", lambda name, result: True)
    tier.update_golden(_results(1.5, MOVED))  # another CPU kind's base: a second variant
    variants = json.loads(golden.read_text())["dpo"]
    assert [v["base_val_loss"] for v in variants] == [1.25, 1.5]
    lines = tier.update_golden(_results(1.25, {"train/loss": [2.0, 2.0, 2.0]}))  # numerics moved on purpose
    variants = json.loads(golden.read_text())["dpo"]
    assert [v["base_val_loss"] for v in variants] == [1.25] and "dpo" in lines[-1]
