"""`trainer.data.fingerprint.prepared_fingerprint`: a hash of prepared data that changes with any
token, label, order or held-out answer, and ignores only the fields it is told to."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from trainer.data.fingerprint import prepared_fingerprint
from trainer.data.packing import PackedRows


@dataclass
class _Prepared:
    tokenizer: object
    train: PackedRows
    answers: list[str]
    ref: torch.Tensor


def _prepared(ids: torch.Tensor, answers: list[str], ref: float = float("nan")) -> _Prepared:
    rows = PackedRows(input_ids=ids, labels=ids.roll(-1, 1), position_ids=ids * 0, document_ids=ids * 0)
    return _Prepared(tokenizer=object(), train=rows, answers=answers, ref=torch.full((2,), ref))


def test_equal_data_hashes_equal_and_any_change_moves_it() -> None:
    ids = torch.arange(12).reshape(3, 4)
    skip = ("tokenizer", "ref")
    base = prepared_fingerprint(_prepared(ids, ["a", "b"]), skip=skip)
    assert base == prepared_fingerprint(_prepared(ids.clone(), ["a", "b"], ref=1.0), skip=skip)  # skipped fields
    changed = ids.clone()
    changed[2, 3] = 99
    assert prepared_fingerprint(_prepared(changed, ["a", "b"]), skip=skip) != base  # one token
    assert prepared_fingerprint(_prepared(ids.flip(0), ["a", "b"]), skip=skip) != base  # row order
    assert prepared_fingerprint(_prepared(ids, ["b", "a"]), skip=skip) != base  # held-out answers
    assert prepared_fingerprint(_prepared(ids.to(torch.int32), ["a", "b"]), skip=skip) != base  # dtype
    assert prepared_fingerprint(_prepared(ids.reshape(4, 3), ["a", "b"]), skip=skip) != base  # shape


def test_arrays_scalars_and_unknown_types() -> None:
    a = {"x": np.arange(5), "n": 3, "t": torch.tensor(2), "flag": torch.tensor([True, False])}
    assert prepared_fingerprint(a) == prepared_fingerprint(dict(reversed(a.items())))  # keys sorted
    assert prepared_fingerprint({**a, "x": np.arange(1, 6)}) != prepared_fingerprint(a)
    with pytest.raises(TypeError, match="cannot hash a generator"):
        prepared_fingerprint({"g": (i for i in range(2))})


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("pretrain", []),
        ("sft", ["data.seq_len=128", "train.global_batch_size=4"]),
        ("preference", []),
        ("preference", ["objective=kto", "data.unpaired=true"]),
        ("grpo", []),
    ],
)
def test_every_data_module_fingerprints_its_prepared_data(recipe: str, overrides: list[str]) -> None:
    """Each recipe's data module (rest's rounds build SFT data) hashes what it prepared (no type it
    cannot walk), the same in a fresh module over the session's cache (what a resumed process
    computes), another for other rows."""
    from harness import compose_config

    from trainer.build import build_data
    from trainer.config import validate

    def fingerprint(*extra: str) -> str:
        small = [] if recipe == "pretrain" else ["model=nano"]
        cfg = compose_config([*small, *overrides, *extra], recipe=recipe, tiny=recipe == "pretrain")
        return build_data(cfg, validate(cfg)).data_fingerprint()

    first = fingerprint()
    assert len(first) == 16 and fingerprint() == first
    # other rows: another packing for pretraining (its tokenizer trained once), another split else
    assert fingerprint("data.seq_len=32" if recipe == "pretrain" else "seed=1") != first
