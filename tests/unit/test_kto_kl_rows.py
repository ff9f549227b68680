"""KTO's KL rows follow TRL's rule: each labelled row's mismatched completion answers another prompt,
and the mismatched completions are the matched ones, permuted (TRL's KTOTrainer builds its KL
dataset by rolling the completions of an unpaired batch, whose chosen rows all precede its
rejected rows, so no row meets its own prompt's answer).

The checks are written here, on the records plait's data module hands to the tokenizer
(`PreferenceDataModule._records`), and on the encoded rows it trains on. On plait before this test
the mismatched completion was the next row's, and a pair's chosen and rejected rows are
consecutive: 284 of the 568 bundled ``dpo_en`` rows paired a prompt with its own other answer.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from trainer.build import build_data
from trainer.compose import compose
from trainer.data.base import DataError


def _kto_data(overrides: list[str]):
    cfg = compose("kto", ["model=nano", "train.global_batch_size=8", *overrides])
    return build_data(cfg)


def _prompt(record) -> str:
    return json.dumps(record["messages"], sort_keys=True)


def _check_kl_rows(rows: list[dict]) -> None:
    answers: dict[str, set[str]] = {}
    for r in rows:
        answers.setdefault(_prompt(r), set()).add(r["chosen"])
    own = [r for r in rows if r["rejected"] in answers[_prompt(r)]]
    assert len(own) == 0, f"{len(own)} of {len(rows)} KL rows pair a prompt with an answer to that prompt"
    assert Counter(r["rejected"] for r in rows) == Counter(r["chosen"] for r in rows)  # a permutation


def test_no_kl_row_of_the_bundled_pairs_meets_its_own_prompt() -> None:
    data = _kto_data([])
    ((name, source),) = data.sources.items()
    train, val = data._records(name, source)
    # every pair gives a desirable and an undesirable row; one of the 300 pairs repeats a held-out one
    assert len(train) == 2 * (300 - 16 - 1)
    for rows in (train, val):
        _check_kl_rows(rows)
    # The encoded rows the objective reads: row 0 the labelled completion, row 1 its KL row.
    prepared = data.prepare()
    assert prepared.train["input_ids"].shape[:2] == (len(train), 2)
    assert prepared.train["desirable"].tolist() == [r["desirable"] for r in train]


def test_repeated_prompts_never_meet_their_own_answers(tmp_path) -> None:
    # Unpaired rows where one prompt has three completions and others one or two.
    rows = [{"prompt": "p0", "completion": f"a{i}", "label": i % 2 == 0} for i in range(3)]
    rows += [
        {"prompt": f"p{k}", "completion": f"b{k}{i}", "label": i == 0} for k in range(1, 5) for i in range(1 + k % 2)
    ]
    path = tmp_path / "kto.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = _kto_data([f"data.sources={{mine: {{source: {path}, val_size: 0}}}}", "train.global_batch_size=2"])
    train, _ = data._records("mine", data.sources["mine"])
    assert len(train) == len(rows)
    _check_kl_rows(train)


def test_a_prompt_holding_most_rows_is_refused_naming_the_source(tmp_path) -> None:
    rows = [{"prompt": "same", "completion": f"a{i}", "label": True} for i in range(3)]
    rows.append({"prompt": "other", "completion": "b", "label": False})
    path = tmp_path / "kto.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = _kto_data([f"data.sources={{mine: {{source: {path}, val_size: 0}}}}", "train.global_batch_size=2"])
    with pytest.raises(
        DataError, match=r"data.sources.mine: 3 of its 4 train rows share one prompt.*add rows with other prompts"
    ):
        data.prepare()
