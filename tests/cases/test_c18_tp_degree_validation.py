"""Case C18 — tensor-parallel degree not validated against the KV-head count (pytorch/torchtitan#2574).

Scenario: n_heads=32, n_kv_heads=2, tp=4; and n_heads=28, tp=8. Expected: a config-time error,
before any weights or processes exist, naming the field and listing the valid degrees — {1, 2}
and {1, 2, 4, 7, 14, 28} — never a reshape error inside ``forward``. The same check guards the
plugin itself (a model built outside the config path), before any weight is sharded.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from harness import compose_config

from strategies.core.parallel_dims import LayoutError
from strategies.tensor import TensorParallel
from trainer.config import ConfigError, validate
from trainer.models.llama import Llama

SCENARIOS = [
    # n_heads, n_kv_heads, dim, tp, the valid degrees the message must list
    (32, 2, 64, 4, "valid tp: 1, 2"),
    (28, 28, 56, 8, "valid tp: 1, 2, 4, 7, 14, 28"),
]


@pytest.mark.parametrize(("n_heads", "n_kv_heads", "dim", "tp", "valid"), SCENARIOS)
def test_validate_names_tp_and_lists_the_valid_degrees(n_heads, n_kv_heads, dim, tp, valid) -> None:
    cfg = compose_config(
        [
            "strategy=tp",
            f"trainer.devices={tp}",
            f"model.dim={dim}",
            f"model.n_heads={n_heads}",
            f"model.n_kv_heads={n_kv_heads}",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
        ]
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert f"strategy.tp={tp} does not divide n_heads={n_heads} and n_kv_heads={n_kv_heads}; {valid}" in str(err.value)


@pytest.mark.parametrize(("n_heads", "n_kv_heads", "dim", "tp", "valid"), SCENARIOS)
def test_plugin_refuses_before_sharding(n_heads, n_kv_heads, dim, tp, valid) -> None:
    model = Llama(vocab_size=64 * tp, dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=8 * tp)
    with pytest.raises(LayoutError, match=valid):
        TensorParallel().apply(
            model, {"tp": SimpleNamespace(size=lambda: tp)}
        )  # fails on sizes, before the mesh is used


def test_vocabulary_must_split_or_be_padded() -> None:
    cfg = compose_config(["strategy=tp", "trainer.devices=2", "data.vocab_size=4095"])
    with pytest.raises(
        ConfigError, match=r"strategy.tp=2 does not divide the vocabulary size 4095 .* \+model.vocab_size=4096"
    ):
        validate(cfg)
    validate(compose_config(["strategy=tp", "trainer.devices=2", "data.vocab_size=4095", "+model.vocab_size=4096"]))


def test_a_tokenizer_file_is_checked_when_the_model_is_built() -> None:
    from trainer.build import build_model

    cfg = compose_config(["strategy=tp", "trainer.devices=2"])
    with pytest.raises(ConfigError, match=r"does not divide the tokenizer's 4095 tokens.*\+model.vocab_size=4096"):
        build_model(cfg, validate(cfg), vocab_size=4095)
    cfg = compose_config(["+model.vocab_size=4000"])
    with pytest.raises(ConfigError, match="model.vocab_size=4000 is smaller than the tokenizer's 4096 tokens"):
        build_model(cfg, validate(cfg), vocab_size=4096)
