"""The golden curves of the learning tier: each entry's first `GOLDEN_STEPS` optimizer steps, stored in
``tests/learns/golden.json`` and compared at a relative `GOLDEN_RTOL`; for an entry started from a
base, one curve per end state of its base (`base_fingerprint`). `tests/learns/tier.py` writes them
(``--update-golden``), `tests/learns/test_learns.py` compares them (`golden_verdict`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from learns.checks import Result
from learns.entries import ENTRIES, passed

GOLDEN = Path(__file__).with_name("golden.json")
GOLDEN_STEPS = 8
# Relative tolerance of the golden curves. Runs at one thread on one CPU model repeat bit for bit;
# 1e-6 leaves room for other kernels (the sft entry's curve under MKL/oneDNN limited to SSE4 moved
# by at most 1.8e-7) without hiding a changed number.
GOLDEN_RTOL = 1e-6
GOLDEN_KEYS = (
    "train/loss",
    "train/rewards/accuracy",
    "train/rewards/margin",
    "train/rewards/chosen",
    "train/rewards/rejected",
    "train/rewards/mismatched",
    "train/kl",
    "train/reward",
)


def golden_curves() -> dict[str, Any]:
    """golden.json: an entry trained from scratch maps to its curve (``{key: [8 values]}``); an
    entry that starts from a base maps to a list of **variants**, ``{"base_val_loss", "curve"}``,
    one per end state of its base seen so far (`base_fingerprint`; ``null`` where it was not
    recorded)."""
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def curve_mismatch(
    stored: dict[str, list[float]], curve: dict[str, list[float]], rtol: float = GOLDEN_RTOL
) -> list[str]:
    """Where ``curve`` differs from ``stored`` by more than ``rtol`` (relative; an absolute floor of
    ``rtol`` for values near 0), one line per key."""
    problems = []
    for key in sorted(set(stored) | set(curve)):
        a, b = stored.get(key), curve.get(key)
        if a is None or b is None or len(a) != len(b):
            problems.append(f"{key}: stored {a} vs now {b}")
            continue
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not abs(x - y) <= rtol * max(abs(x), abs(y), 1.0)]
        if bad:
            i = bad[0]
            problems.append(f"{key}: step {i + 1} stored {a[i]!r} now {b[i]!r} ({len(bad)} of {len(a)} steps differ)")
    return problems


def base_fingerprint(results: dict[str, Result], name: str) -> float | None:
    """The end state of entry ``name``'s base: the base's last held-out ``val/loss`` (None for an
    entry trained from scratch).

    A base trains hundreds of steps; the last-bit differences between CPU kinds' kernels (AVX-512 on
    an Intel Xeon and on an AMD EPYC: the first 8 steps agree to 1e-7) grow over them into another
    model (the sft base's val/loss 1.224 on one, 1.243 on the other), and every entry started from
    it gets another curve. So such an entry's curve is stored per end state of its base."""
    base = ENTRIES[name].base
    if base is None:
        return None
    evals = results.get(base, {}).get("evals") or [{}]
    return evals[-1].get("val/loss")


def golden_verdict(name: str, results: dict[str, Result]) -> tuple[str, str]:
    """Entry ``name``'s curve against golden.json: ``("ok" | "moved" | "unseen base" | "missing", why)``.

    An entry from scratch must equal its stored curve. An entry from a base passes when it equals
    any variant's curve; it has **moved** when a variant started from this same base end state
    differs (a change of numerics), and its base is **unseen** when no variant started from it
    (another CPU kind, nothing to compare with: the base's own curve is still checked)."""
    stored, curve = golden_curves().get(name), results[name]["curve"]
    fix = "python tests/learns/tier.py --update-golden"
    if stored is None:
        return "missing", f"no golden curve for {name}: {fix}"
    if ENTRIES[name].base is None:
        problems = curve_mismatch(stored, curve)
        return ("moved", "\n  ".join(problems)) if problems else ("ok", "")
    if any(not curve_mismatch(variant["curve"], curve) for variant in stored):
        return "ok", ""
    fingerprint = base_fingerprint(results, name)
    for variant in stored:
        if _same(variant["base_val_loss"], fingerprint):
            return "moved", "\n  ".join(curve_mismatch(variant["curve"], curve))
    return "unseen base", (
        f"{name} starts from {ENTRIES[name].base}, which ended here at val/loss {fingerprint!r}: none of the "
        f"{len(stored)} stored curves of {name} started from that model (another CPU kind's rounding over the "
        f"base's run), so its first steps are not compared on this machine. To add this machine's: {fix}"
    )


def golden_line(name: str, results: dict[str, Result]) -> str:
    """``golden: dpo not compared: ...`` for an entry whose curve is not ``ok``; "" otherwise."""
    result = results[name]
    if "error" in result or not result.get("curve"):
        return ""
    verdict, why = golden_verdict(name, results)
    return "" if verdict == "ok" else f"golden: {name:<11} {verdict.upper()}: {why}"


def _same(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= GOLDEN_RTOL * max(abs(a), abs(b), 1.0)


def update_golden(results: dict[str, Result]) -> list[str]:
    """Writes the curves of the entries that passed to golden.json; the lines to print.

    An entry from a base: its variant for this base end state is replaced (or added); when that
    changes a stored curve, or its base's curve changed (numerics moved on purpose), its variants
    from other base end states are dropped, since they are stale too (rewrite them on those machines)."""
    stored = golden_curves()
    written = [name for name, r in results.items() if passed(name, r) and r.get("curve")]
    kept = [name for name in results if name not in written and name in stored]
    dropped, moved = [], set()
    for name in written:  # bases first (`needed`)
        curve = results[name]["curve"]
        if ENTRIES[name].base is None:
            if name in stored and curve_mismatch(stored[name], curve):
                moved.add(name)
            stored[name] = curve
            continue
        fingerprint, variants = base_fingerprint(results, name), stored.get(name, [])
        if not isinstance(variants, list):
            variants = [{"base_val_loss": None, "curve": variants}]
        same = [v for v in variants if _same(v["base_val_loss"], fingerprint) or not curve_mismatch(v["curve"], curve)]
        if ENTRIES[name].base in moved or any(curve_mismatch(v["curve"], curve) for v in same):
            dropped += [name] if len(variants) > len(same) else []
            variants = []
        else:
            variants = [v for v in variants if v not in same]
        stored[name] = [*variants, {"base_val_loss": fingerprint, "curve": curve}]
    GOLDEN.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")
    lines = [f"golden curves written for {len(written)} entries: {', '.join(written) or '-'}"]
    if kept:
        lines.append(f"golden curves kept (their runs failed): {', '.join(kept)}")
    if dropped:
        lines.append(f"curves from other base end states dropped (stale; rewrite them there): {', '.join(dropped)}")
    return lines
