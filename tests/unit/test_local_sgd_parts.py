"""Local-SGD pieces without processes: fragment schedule, byte counts, and the checks before launch."""

from __future__ import annotations

import pytest
from harness import compose_config

from strategies.local_sgd import DESLOC, DiLoCo, Hierarchical, allreduce_bytes_sent
from strategies.local_sgd.diloco import assign_fragments, fragment_offset
from strategies.local_sgd.ist import IST
from trainer.config import ConfigError, validate
from trainer.models.llama import Llama


def test_fragments_sync_at_staggered_steps_each_every_h() -> None:
    # H = 8, 4 fragments: one fragment every 2 steps, the last at multiples of H (plain DiLoCo's steps).
    offsets = [fragment_offset(f, num_fragments=4, sync_every=8) for f in range(4)]
    assert offsets == [2, 4, 6, 0]
    due = {t: [f for f in range(4) if t % 8 == offsets[f]] for t in range(1, 17)}
    assert [t for t, fs in due.items() if fs] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(len(fs) == 1 for fs in due.values() if fs)
    assert fragment_offset(0, num_fragments=1, sync_every=8) == 0  # DiLoCo
    assert {fragment_offset(f, num_fragments=2, sync_every=1) for f in range(2)} == {0}  # H = 1: every step


def test_blocks_are_strided_over_fragments_and_the_rest_goes_last() -> None:
    model = Llama(vocab_size=32, dim=16, n_layers=4, n_heads=2, n_kv_heads=1, max_seq_len=8)
    names = [n for n, _ in model.named_parameters()]
    fragments = assign_fragments(model, names, 2)
    assert {fragments[n] for n in names if n.startswith(("layers.0.", "layers.2."))} == {0}
    assert {fragments[n] for n in names if n.startswith(("layers.1.", "layers.3."))} == {1}
    assert fragments["tok_embeddings.weight"] == fragments["output.weight"] == fragments["norm.weight"] == 1


def test_ring_allreduce_bytes() -> None:
    assert allreduce_bytes_sent(1000, 1) == 0.0
    assert allreduce_bytes_sent(1000, 2) == 1000.0
    assert allreduce_bytes_sent(1000, 4) == 1500.0


def test_desloc_periods_default_to_3x_and_6x() -> None:
    assert DESLOC(param_every=16).every == {"param": 16, "exp_avg": 48, "exp_avg_sq": 96}
    with pytest.raises(ValueError, match="exp_avg_every=0 must be >= 1"):
        DESLOC(param_every=4, exp_avg_every=0)
    with pytest.raises(ValueError, match="sync_every=0 must be >= 1"):
        DiLoCo(sync_every=0)


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(list(overrides)))
    return err.value.problems


def test_one_island_is_rejected_with_the_fix() -> None:
    problems = _problems("strategy=diloco", "trainer.devices=1")
    assert any("needs at least 2 islands but strategy.dp_replicate=1" in p and "trainer.devices" in p for p in problems)


def test_desloc_needs_adam_moments() -> None:
    problems = _problems("strategy=desloc", "trainer.devices=2", "optim=sgd")
    assert any("keeps no exp_avg/exp_avg_sq for every parameter; use optim=adamw" in p for p in problems)
    validate(compose_config(["strategy=desloc", "trainer.devices=2", "optim=adamw"]))


def test_desloc_refuses_muon_whose_matrices_keep_a_momentum_buffer_only() -> None:
    """Muon's AdamW part (scalars, embeddings) would pass a probe on one scalar parameter."""
    problems = _problems("strategy=desloc", "trainer.devices=2", "optim=muon")
    assert any("keeps no exp_avg/exp_avg_sq for every parameter" in p for p in problems)


def test_bad_periods_and_fragments_are_reported() -> None:
    assert any(
        "sync_every=0 must be >= 1" in p
        for p in _problems("strategy=diloco", "trainer.devices=2", "strategy.local_sgd.sync_every=0")
    )
    problems = _problems("strategy=streaming_diloco", "trainer.devices=2", "strategy.local_sgd.num_fragments=3")
    assert any(
        "num_fragments=3 exceeds the model's 2 blocks; use strategy.local_sgd.num_fragments<=2" in p for p in problems
    )


def test_a_run_that_ends_apart_or_never_synchronises_says_so(capsys) -> None:
    """strategy=diloco with trainer.max_steps=10 (sync every 50) sent 0 bytes in silence; with
    sync_every=4 it ended 2 steps after its last outer step, the islands apart (a new user's walkthrough)."""
    DiLoCo(sync_every=50).run_length(10)
    assert "strategy.local_sgd.sync_every=50 is longer than the run's 10 planned steps: the islands never" in (
        capsys.readouterr().err
    )
    DiLoCo(sync_every=4).run_length(10)
    assert "the run's 10 planned steps end 2 after its last synchronisation (strategy.local_sgd.sync_every=4)" in (
        capsys.readouterr().err
    )
    DiLoCo(sync_every=5).run_length(10)
    assert capsys.readouterr().err == ""
    DiLoCo(sync_every=50, num_fragments=2).run_length(10)  # streaming: never before the first fragment's (step 25)
    assert "end before its first fragment's synchronisation (step 25;" in capsys.readouterr().err
    # streaming: each fragment meets at its own offset, so no run ends on one model (a reviewer: islands
    # differed by 2e-3 in layer 0 after 8 steps with sync_every=4, with no word at launch)
    DiLoCo(sync_every=4, num_fragments=2).run_length(8)
    assert "num_fragments=2: each fragment synchronises at its own steps, so the run's 8 planned steps end with" in (
        capsys.readouterr().err
    )
    DiLoCo(sync_every=1, num_fragments=2).run_length(8)  # every fragment meets at every step (a reviewer)
    assert capsys.readouterr().err == ""
    DESLOC(param_every=16).run_length(10)
    err = capsys.readouterr().err
    assert err.count("plait: warning:") == 1 and "strategy.local_sgd.param_every=16 is longer" in err
    IST(sync_every=4).run_length(10)  # reassembled at the end: said, not a warning
    err = capsys.readouterr().err
    assert "10 planned steps make 3 rounds, the last of 2 steps instead of strategy.local_sgd.sync_every=4" in err
    assert "warning" not in err
    IST(sync_every=5).run_length(10)
    assert capsys.readouterr().err == ""


def test_hierarchical_without_a_cooldown_says_when_the_islands_end_apart(capsys) -> None:
    """strategy=hierarchical (no cool-down) ended 2 steps after its last synchronisation, and with
    delay=2 a sum sent at step 4 was never merged by the end at step 5, both in silence (a reviewer)."""
    Hierarchical(sync_every=4).run_length(6)
    assert "the run's 6 planned steps end 2 after its last synchronisation (every strategy.local_sgd.sync_every=4" in (
        capsys.readouterr().err
    )
    Hierarchical(sync_every=4, warmup_steps=2).run_length(6)  # synchronised at step 6: warm-up 2 + 4
    Hierarchical(sync_every=4).run_length(8)
    Hierarchical(sync_every=4, cooldown_steps=2).run_length(7)  # the cool-down ends it on one model
    assert capsys.readouterr().err == ""
    Hierarchical(sync_every=4, delay=2).run_length(8)
    assert "a sum is merged 2 steps late and strategy.local_sgd.cooldown_steps=0" in capsys.readouterr().err
    Hierarchical(sync_every=4, adaptive=True).run_length(8)
    assert "the period follows the loss (adaptive)" in capsys.readouterr().err
