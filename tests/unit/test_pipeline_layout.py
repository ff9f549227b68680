"""Pipeline layout: stage split, stage placement, the views that share a rank's modules, and every
config problem reported before launch with its fix."""

from __future__ import annotations

import pytest
import torch
from harness import compose_config
from omegaconf import OmegaConf

from strategies.pipeline.layout import check_pipeline, local_stages, stage_layers, stage_owner
from strategies.pipeline.stages import split_model
from trainer.config import ConfigError, validate
from trainer.models.llama import Llama


def test_balanced_split_gives_the_remainder_to_the_first_stages() -> None:
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert stage_layers(5, 2, split_points=[1]) == [range(0, 1), range(1, 5)]
    for bad in ([0], [5], [3, 2], [1, 2]):
        with pytest.raises(ValueError, match="increasing layer indices"):
            stage_layers(5, 2, split_points=bad)
    with pytest.raises(ValueError, match="at least 3 layers"):
        stage_layers(2, 3)


def test_looped_and_v_placement() -> None:
    assert [local_stages(r, pp=2, stages_per_rank=2, schedule="Interleaved1F1B") for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [local_stages(r, pp=2, stages_per_rank=2, schedule="ZBV") for r in (0, 1)] == [[0, 3], [1, 2]]
    assert [stage_owner(s, pp=4, schedule="DualPipeV") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [local_stages(r, pp=4, stages_per_rank=1, schedule="1F1B") for r in range(4)] == [[0], [1], [2], [3]]


def _llama(n_layers: int = 4) -> Llama:
    torch.manual_seed(0)
    return Llama(vocab_size=32, dim=16, n_layers=n_layers, n_heads=2, max_seq_len=16)


def test_split_keeps_global_names_and_views_share_the_modules() -> None:
    full = _llama()
    model = _llama()
    views = split_model(model, stages=[0, 3], layers=stage_layers(4, 4))  # rank 0 of ZBV on pp=2
    assert [n for n, _ in model.named_parameters() if n.startswith("layers")] == [
        n for n, _ in full.named_parameters() if n.startswith(("layers.0.", "layers.3."))
    ]
    assert model.tok_embeddings is not None and model.output is not None and model.norm is not None
    first, last = views
    assert first.output is None and first.norm is None and list(first.layers) == ["0"]
    assert last.tok_embeddings is None and list(last.layers) == ["3"]
    assert first.layers["0"] is model.layers["0"] and last.output is model.output
    # The views compose to the full model's first and last layer.
    ids = torch.randint(0, 32, (2, 8))
    hidden = first(ids)
    reference = full.tok_embeddings(ids)
    cos, sin = full.rope_cos[:8][None, :, None, :], full.rope_sin[:8][None, :, None, :]
    reference = full.layers["0"](reference, cos, sin, None)
    torch.testing.assert_close(hidden, reference)
    single = split_model(_llama(), stages=[1], layers=stage_layers(4, 2))
    assert len(single) == 1 and single[0].tok_embeddings is None and list(single[0].layers) == ["2", "3"]


def test_check_pipeline_names_the_fix() -> None:
    def problems(**kw):
        args = dict(
            pp=2,
            schedule="1F1B",
            stages_per_rank=None,
            split_points=None,
            num_microbatches=None,
            microbatches_per_step=4,
            n_layers=4,
        )
        return "\n".join(check_pipeline(**{**args, **kw}))

    assert problems() == "" and problems(pp=1, schedule="nope") == ""
    assert "use model.n_layers >= 4 or a smaller strategy.pp" in problems(n_layers=2, schedule="ZBV")
    assert "runs one stage per rank" in problems(stages_per_rank=2)
    assert "runs exactly 2 stages per rank" in problems(schedule="DualPipeV", stages_per_rank=3)
    assert "needs at least pp=2 micro-batches per schedule step, got 1" in problems(microbatches_per_step=1)
    assert "needs at least 2 x pp=4 micro-batches" in problems(schedule="DualPipeV", microbatches_per_step=2)
    assert "not a multiple of its 2 rounds; use 4" in problems(schedule="Interleaved1F1B", microbatches_per_step=5)
    assert "not a multiple of strategy.pipeline.num_microbatches=3" in problems(num_microbatches=3)
    assert "model.tie_embeddings=false or strategy.pp=1" in problems(tie_embeddings=True)
    assert "give 1 points or null" in problems(split_points=[4])
    assert "unknown; use one of GPipe, 1F1B" in problems(schedule="2F2B")


def _problems(overrides: list[str]) -> list[str]:
    cfg = compose_config(["strategy=pp", "trainer.devices=2", *overrides])
    before = OmegaConf.to_yaml(cfg)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert OmegaConf.to_yaml(cfg) == before
    return err.value.problems


def test_config_reports_every_pipeline_problem_before_launch() -> None:
    validate(compose_config(["strategy=pp", "trainer.devices=2", "strategy.pipeline.schedule=GPipe"]))
    problems = _problems(["model.tie_embeddings=true", "train.micro_batch_size=8", "data.drop_last=false"])
    assert len(problems) == 3, problems
    assert any("needs at least pp=2 micro-batches per schedule step, got 1" in p for p in problems)
    assert any("use model.tie_embeddings=false or strategy.pp=1" in p for p in problems)
    assert any("use data.drop_last=true" in p for p in problems)
    (bad_name,) = _problems(["strategy.pipeline.schedule=2F2B"])
    assert bad_name.startswith("strategy.pipeline.schedule='2F2B' must be one of GPipe, 1F1B, Interleaved1F1B")
    (too_few_layers,) = _problems(["strategy.pipeline.schedule=Interleaved1F1B"])  # nano: 2 layers, 4 stages
    assert "4 stages exceeds model.n_layers=2; use model.n_layers >= 4" in too_few_layers


def test_null_micro_batch_size_means_one_row_per_pipeline_micro_batch() -> None:
    cfg = compose_config(["strategy=pp", "trainer.devices=2", "train.micro_batch_size=null"])
    run = validate(cfg)  # 8 micro-batches of 1 row, not 1 micro-batch of 8 rows (which 1F1B cannot schedule)
    assert (run.micro_batch_size, run.num_micro_batches, run.pp_microbatches) == (1, 8, 8)
    run = validate(compose_config(["trainer.devices=2", "train.micro_batch_size=null"]))
    assert (run.micro_batch_size, run.num_micro_batches) == (4, 1)


def test_balanced_split_points():
    import itertools
    import random

    from strategies.pipeline.layout import balanced_split_points

    # Equal costs: exactly the layer-count split.
    for n, stages in [(4, 2), (10, 4), (7, 3), (16, 8)]:
        assert balanced_split_points([1.0] * n, stages) == [r.start for r in stage_layers(n, stages)][1:]
    # A head worth 2 blocks moves one block off the last stage; a heavy embedding off the first.
    assert balanced_split_points([1.0] * 4, 2, last=2.0) == [3]
    assert balanced_split_points([1.0] * 6, 2, first=2.0) == [2]
    # Uneven costs: the smallest possible maximum stage cost, against every split by brute force.
    rng = random.Random(0)
    for _ in range(20):
        n, stages = rng.randint(3, 9), rng.randint(2, 3)
        costs, first, last = [rng.uniform(0.5, 2.0) for _ in range(n)], rng.uniform(0, 1), rng.uniform(0, 3)

        def worst(points):
            bounds = [0, *points, n]
            parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
            parts[0] += first
            parts[-1] += last
            return max(parts)

        best = min(worst(c) for c in itertools.combinations(range(1, n), stages - 1))
        assert worst(balanced_split_points(costs, stages, first=first, last=last)) == pytest.approx(best)
    with pytest.raises(ValueError, match="at least 3 layers"):
        balanced_split_points([1.0] * 2, 3)


def test_auto_split_with_split_points_is_refused():
    problems = check_pipeline(
        pp=2,
        schedule="1F1B",
        stages_per_rank=None,
        split_points=[1],
        num_microbatches=None,
        microbatches_per_step=None,
        n_layers=4,
        split="auto",
    )
    assert any("split=auto chooses the split points itself" in p for p in problems)
