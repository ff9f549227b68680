"""Planner pieces without processes: presets, layout round trip, search, report, planner.check."""

from __future__ import annotations

import re

import pytest

from strategies.core.shape import ModelShape
from strategies.planner.memory import predict_memory
from strategies.planner.search import SearchSpace, search
from trainer.compose import compose
from trainer.config import ConfigError, validate
from trainer.planning import check_memory, cluster_from_config, plan, planner_inputs


def _inputs(cfg):
    """``(shape, layout, workload)`` of a composed run, as the planner receives them."""
    return planner_inputs(cfg, validate(cfg))


PUBLISHED_PARAMS = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800}


@pytest.mark.parametrize("model", list(PUBLISHED_PARAMS))
def test_presets_have_published_parameter_counts(model):
    assert validate(compose("pretrain", [f"model={model}"])).shape.num_params == PUBLISHED_PARAMS[model]


def test_layout_overrides_round_trip():
    cfg = compose("pretrain", ["model=llama3_8b", "cluster=h100x64", "data.seq_len=8192", "train.global_batch_size=64"])
    (shape, _, work), cluster = _inputs(cfg), cluster_from_config(cfg)
    plans = search(shape, work, cluster, SearchSpace(max_micro_batch=2))
    assert plans and plans[0].fits
    # Fitting layouts first, each group fastest first; every layout covers the 64 devices.
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)
    assert all(p.layout.world_size == 64 for p in plans)
    for p in [q for q in plans if q.fits][:4]:
        devices = ["trainer.devices=8", "trainer.num_nodes=8"]
        again = compose(
            "pretrain",
            ["model=llama3_8b", "data.seq_len=8192", "train.global_batch_size=64", *p.layout.overrides(), *devices],
        )
        assert _inputs(again)[1] == p.layout


def test_memory_drops_with_sharding_and_checkpointing():
    cfg = compose(
        "pretrain",
        ["model=llama3_8b", "data.seq_len=8192", "train.global_batch_size=8", "trainer.precision=bf16-mixed"],
    )
    shape, _, work = _inputs(cfg)
    from strategies.planner.layout import Layout

    base = predict_memory(shape, Layout(dp_shard=8), work)
    assert predict_memory(shape, Layout(dp_shard=8, ac="full"), work).activations < base.activations / 5
    # 8-way either way, but tp leaves the norm weights whole on each of its ranks.
    assert base.optimizer < predict_memory(shape, Layout(dp_shard=4, tp=2), work).optimizer < 1.001 * base.optimizer
    assert predict_memory(shape, Layout(dp_replicate=8), work).optimizer > 7 * base.optimizer


def test_plan_prints_table_and_overrides():
    cfg = compose(
        "pretrain",
        [
            "model=llama3_8b",
            "cluster=h100x8",
            "data.seq_len=8192",
            "train.global_batch_size=16",
            "trainer.precision=bf16-mixed",
            "planner.max_micro_batch=1",
            "planner.hsdp=false",
        ],
    )
    text = plan(cfg, validate(cfg))
    assert "tok/s/dev" in text and "overrides: strategy=nd" in text and "trainer.devices=8" in text


def test_check_fails_a_predicted_oom_with_the_breakdown():
    big = compose(
        "pretrain",
        [
            "model=llama3_8b",
            "cluster=h100x8",
            "trainer.devices=1",
            "data.seq_len=8192",
            "train.global_batch_size=1",
            "strategy=fsdp",
            "planner.check=true",
        ],
    )
    with pytest.raises(ConfigError, match=r"planner.check: .* GiB per device.*optimizer"):
        check_memory(big, validate(big))
    fits = compose("pretrain", ["model=nano", "data.seq_len=64", "cluster=cpu", "planner.check=true"])
    check_memory(fits, validate(fits))  # fits: no error


def test_check_without_cluster_names_the_fix():
    with pytest.raises(ConfigError, match="cluster=<preset>"):
        check_memory(cfg := compose("pretrain", ["planner.check=true"]), validate(cfg))


def test_model_shape_reads_tensor_parallel_dims():
    import torch

    from trainer.models.llama import Llama

    with torch.device("meta"):
        shape = ModelShape.from_model(Llama(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2))
    dims = {p.name: p.tp_dim for p in shape.params}
    assert dims["layers.0.attention.wq.weight"] == 0 and dims["layers.0.attention.wo.weight"] == 1
    assert dims["tok_embeddings.weight"] == 0 and dims["output.weight"] == 0 and dims["norm.weight"] is None


def test_a_mixture_of_experts_plan_tries_ep_and_avoids_the_schedules_validate_refuses():
    cfg = compose("pretrain", ["model=qwen3_30b_a3b", "cluster=h100x64", "data.seq_len=4096"])
    (shape, _, work), cluster = _inputs(cfg), cluster_from_config(cfg)
    plans = search(shape, work, cluster, SearchSpace(max_micro_batch=1, ac_modes=("none",)))
    assert shape.num_experts == 128 and plans and {p.layout.ep for p in plans} >= {1, 2, 4, 8}
    assert not [p for p in plans if p.layout.pp_schedule in ("ZBV", "InterleavedZeroBubble", "DualPipeV")]
    best = plans[0].layout
    again = compose(
        "pretrain",
        ["model=qwen3_30b_a3b", "data.seq_len=4096", *best.overrides(), "trainer.devices=8", "trainer.num_nodes=8"],
    )
    assert _inputs(again)[1] == best  # the plan's overrides validate and resolve to its layout, ep included


def test_a_plan_for_attention_sinks_leaves_out_context_parallelism():
    """GPT-OSS's sinks (its windows off: they alone would leave cp out too): no plan with cp > 1,
    which validate refuses; a model without them gets such plans."""
    space = SearchSpace(max_micro_batch=1, ac_modes=("none",))
    for model, cp_plans in (("gpt_oss_tiny model.window_layers=[]", False), ("tiny", True)):
        cfg = compose("pretrain", [*f"model={model}".split(), "cluster=h100x8", "data.seq_len=4096"])
        (shape, _, work), cluster = _inputs(cfg), cluster_from_config(cfg)
        plans = search(shape, work, cluster, space)
        assert plans and any(p.layout.cp > 1 for p in plans) == cp_plans, model


def test_a_plan_for_latent_attention_leaves_out_context_parallelism():
    """DeepSeek-V3's latent attention (validate refuses it under cp): no plan with cp > 1; every plan
    the search returns for it validates."""
    space = SearchSpace(max_micro_batch=1, ac_modes=("none",))
    cfg = compose("pretrain", ["model=deepseek_v3_tiny", "cluster=h100x8", "data.seq_len=4096"])
    (shape, _, work), cluster = _inputs(cfg), cluster_from_config(cfg)
    plans = search(shape, work, cluster, space)
    assert plans and not any(p.layout.cp > 1 for p in plans)
    best = plans[0].layout
    again = compose("pretrain", ["model=deepseek_v3_tiny", "data.seq_len=4096", *best.overrides(), "trainer.devices=8"])
    assert _inputs(again)[1] == best


def test_latent_attentions_scores_span_its_key_and_value_widths(monkeypatch):
    """DeepSeek-V3's scores and weighted values span 128 heads x (192 + 128) features (not dim 7168):
    a block's time holds 3 passes of 2 x tokens x seq_len x 20480 attention FLOPs."""
    from strategies.core.shape import ModelShape
    from strategies.planner.layout import Layout
    from strategies.planner.time import layer_costs

    cfg = compose("pretrain", ["model=deepseek_v3_671b", "cluster=h100x64", "data.seq_len=4096"])
    (shape, _, work), cluster = _inputs(cfg), cluster_from_config(cfg)
    assert shape.attention_width == 128 * (192 + 128) // 2
    layout = Layout(dp_shard=8, pp=8, micro_batch_size=1)
    block = layer_costs(shape, layout, work, cluster)[1][5]
    monkeypatch.setattr(ModelShape, "attention_width", property(lambda s: 0))
    without = layer_costs(shape, layout, work, cluster)[1][5]
    flops = 3 * 2 * 4096 * 4096 * 20480
    assert block - without == pytest.approx(flops / (cluster.peak_flops * cluster.attention_efficiency))


def test_expert_parallelism_trades_expert_gathers_for_all_to_alls():
    from strategies.planner.layout import Layout
    from strategies.planner.time import predict_time

    cfg = compose("pretrain", ["model=qwen3_30b_a3b", "cluster=h100x64", "data.seq_len=4096"])
    (shape, _, work), cluster = _inputs(cfg), cluster_from_config(cfg)
    base = Layout(dp_shard=8, pp=8, micro_batch_size=1)
    one, eight = predict_time(shape, base, work, cluster), predict_time(shape, base.with_(ep=8), work, cluster)
    assert one.ep_comm == 0 < eight.ep_comm
    assert eight.fsdp_comm < one.fsdp_comm / 4  # the experts are most of the weights; each rank gathers 1/8
    assert eight.compute == one.compute


def test_auto_split_balances_predicted_stage_costs():
    """Llama 3 8B on 4 stages: its 128k-vocabulary head costs about 5 blocks, so the layer-count
    split's last stage is the slowest (max/mean > 1.1); the auto split brings max/mean under 1.1."""
    import torch
    from omegaconf import OmegaConf

    from strategies.core.shape import ModelShape
    from strategies.planner.layout import Layout, Workload
    from strategies.planner.time import Cluster, auto_split_points, stage_costs
    from trainer.model_node import instantiate_model

    model_cfg = OmegaConf.load("conf/model/llama3_8b.yaml")
    with torch.device("meta"):
        shape = ModelShape.from_model(instantiate_model(model_cfg, vocab_size=model_cfg.get("vocab_size") or 128256))
    work, cluster = Workload(seq_len=8192, global_batch_size=32, compute_dtype="bf16"), Cluster()
    layout = Layout(pp=4, dp_shard=2, micro_batch_size=1)

    def imbalance(costs):
        return max(costs) / (sum(costs) / len(costs))

    assert imbalance(stage_costs(shape, layout, work, cluster)) > 1.1
    points = auto_split_points(shape, layout, work, cluster)
    balanced = layout.with_(split_points=tuple(points))
    assert imbalance(stage_costs(shape, balanced, work, cluster)) <= 1.1
    assert f"strategy.pipeline.split_points=[{','.join(map(str, points))}]" in balanced.overrides()


def test_auto_split_is_resolved_once_and_built_into_the_pipeline():
    """strategy.pipeline.split=auto: the split points are a fact of the resolved run (the planner's
    balanced points for the run's layout on cluster=), which the builder hands to the pipeline
    plugin; the composed config and the run are left as they were."""
    from strategies.planner.time import auto_split_points
    from trainer.build import build_strategy

    common = [
        "model=llama3_8b",
        "strategy=pp",
        "trainer.devices=4",
        "data.seq_len=8192",
        "train.global_batch_size=32",
        "cluster=h100x8",
    ]
    cfg = compose("pretrain", [*common, "strategy.pipeline.split=auto"])
    run = validate(cfg)
    shape, layout, work = planner_inputs(cfg, run)
    assert run.pp_split_points == tuple(
        auto_split_points(shape, layout.with_(split_points=None), work, cluster_from_config(cfg))
    )
    assert run.pp_split_points != (8, 16, 24)  # the 128k-vocabulary head weighs: not the layer-count split
    assert layout.split_points == run.pp_split_points
    strategy = build_strategy(cfg, run)
    assert strategy.plugins["pipeline"].split_points == list(run.pp_split_points)
    assert cfg.strategy.pipeline.split_points is None
    given = validate(compose("pretrain", [*common, "strategy.pipeline.split_points=[4,12,20]"]))
    assert given.pp_split_points == (4, 12, 20)
    assert validate(compose("pretrain", common)).pp_split_points is None  # split=layers: equal layer counts


@pytest.mark.parametrize("model", ["llama3_8b", "deepseek_v3_tiny", "gemma3_tiny"])
def test_alike_blocks_counted_once_are_the_ranks_tensors(model):
    """`rank_param_counts` (what `state_bytes` and the step time sum over: one term per kind of
    block) expands to exactly `rank_params`, the tensors a pp rank keeps, for dense, MoE (dense
    first blocks, then expert blocks) and sliding-window families, over pipeline splits."""
    from collections import Counter

    from strategies.planner.layout import Layout
    from strategies.planner.ranks import rank_param_counts, rank_params

    shape = _inputs(compose("pretrain", [f"model={model}", "cluster=h100x8"]))[0]
    assert len(shape.block_kinds[1]) < shape.n_layers or shape.n_layers <= 2
    layouts = [Layout(), Layout(pp=2), Layout(pp=2, stages_per_rank=2, pp_schedule="Interleaved1F1B")]
    for layout in layouts:
        for pp_rank in range(layout.pp):
            kept = Counter(
                (p.name.split(".", 2)[-1] if p.layer is not None else p.name, p.shape, p.tp_dim, p.grad_tp_replicated)
                for p in rank_params(shape, layout, pp_rank)
            )
            counted = Counter()
            for p, n in rank_param_counts(shape, layout, pp_rank):
                key = (
                    p.name.split(".", 2)[-1] if p.layer is not None else p.name,
                    p.shape,
                    p.tp_dim,
                    p.grad_tp_replicated,
                )
                counted[key] += n
            assert counted == kept, (model, layout, pp_rank)


def test_the_plan_places_the_command_lines_own_layout() -> None:
    """plait plan ... strategy=tp trainer.devices=2 printed the same table for every strategy, never
    the layout asked for (a new user's walkthrough): its prediction and place among those that fit."""
    cfg = compose("pretrain", ["model=nano", "cluster=cpu", "trainer.devices=2", "strategy=tp"])
    last = plan(cfg, validate(cfg)).splitlines()[-1]
    assert last.startswith("your layout: tp2, predicted ") and " GiB: #" in last and " of the " in last, last
    # a layout the search does not try (DDP with planner.hsdp=false) joins the count it is placed in
    ddp = compose("pretrain", ["model=nano", "cluster=cpu", "trainer.devices=2", "strategy=ddp", "planner.hsdp=false"])
    lines = plan(ddp, validate(ddp)).splitlines()
    fitting = int(re.search(r"(\d+) layouts on", "\n".join(lines))[1]) - int(
        re.search(r"(\d+) dropped", "\n".join(lines))[1]
    )
    assert lines[-1].endswith(f" of the {fitting + 1} that fit"), (fitting, lines[-1])
    one = compose("pretrain", ["model=nano", "cluster=h100x8"])  # one process against 8 devices: not placed
    assert not plan(one, validate(one)).splitlines()[-1].startswith("your layout")


def test_a_local_sgd_layout_is_named_and_exchanges_every_h_steps() -> None:
    """A DiLoCo layout read 'dp_replicate2' in the plan and was timed as DDP (a gradient all-reduce
    across the islands every step) without its anchors and outer momentum."""
    from strategies.planner.time import predict_time

    base = ["model=llama3_8b", "cluster=h100x8", "trainer.devices=8", "train.global_batch_size=8"]
    cfg = compose("pretrain", [*base, "strategy=diloco", "strategy.dp_replicate=2", "strategy.dp_shard=4"])
    cfg.strategy.local_sgd.sync_every = 40
    (shape, layout, work), cluster = _inputs(cfg), cluster_from_config(cfg)
    assert layout.label() == "dp_replicate2 dp_shard4 (diloco H=40)"
    assert (layout.replica_exchange, layout.replica_kept) == (1 / 40, 2)  # anchors + Nesterov momentum
    hsdp = layout.with_(local_sgd="", replica_exchange=1.0, replica_kept=0.0)
    memory, plain = predict_memory(shape, layout, work), predict_memory(shape, hsdp, work)
    assert memory.optimizer - plain.optimizer == 2 * plain.params  # fp32, one unpadded shard each
    islands = predict_time(shape, layout, work, cluster).fsdp_comm
    every_step = predict_time(shape, hsdp, work, cluster).fsdp_comm
    assert islands < every_step  # the islands' all-reduce, 1/40 of it per step, against HSDP's every step
    # the anchors and momentum are touched at an outer step only: not streamed by every optimizer step
    assert predict_time(shape, layout, work, cluster).optimizer == predict_time(shape, hsdp, work, cluster).optimizer
    # torchft replica groups as the islands (dp_replicate 1 in each group's world): still DiLoCo's state
    ft = compose("pretrain", ["model=llama3_8b", "cluster=h100x8", "trainer.devices=4", "train.global_batch_size=8",
                              "strategy=ft_diloco", "strategy.fault_tolerance.replica_group=0"])  # fmt: skip
    ft_shape, ft_layout, ft_work = _inputs(ft)
    assert ft_layout.local_sgd.startswith("diloco H=") and ft_layout.replica_kept == 2
    plain = predict_memory(ft_shape, ft_layout.with_(local_sgd="", replica_kept=0.0), ft_work)
    assert predict_memory(ft_shape, ft_layout, ft_work).optimizer - plain.optimizer == 2 * plain.params
    assert plan(cfg, validate(cfg)).splitlines()[-1].startswith("your layout: dp_replicate2 dp_shard4 (diloco H=40)")


@pytest.mark.parametrize("recipe", ["dpo", "kto"])
def test_a_preference_row_runs_two_model_rows(recipe) -> None:
    """A DPO pair (chosen and rejected) and a KTO example with its KL stand-in each run two rows through
    the model: the planner counted one, predicting half their activations (a reviewer measured 0.50 and
    0.49 of the real peak) and passing planner.check for a run that does not fit. Mutation: the workload
    without rows_per_item halves the ratio below."""
    common = ["model=nano", "data.seq_len=256", "train.micro_batch_size=4", "cluster=cpu"]
    preference = _inputs(compose(recipe, [*common, "data.max_prompt_len=128"]))
    sft = _inputs(compose("sft", common))
    assert preference[2].rows_per_item == 2 and sft[2].rows_per_item == 1
    ratio = predict_memory(*preference).activations / predict_memory(*sft).activations
    assert ratio == pytest.approx(2.0, rel=0.05)


def test_a_model_with_its_own_head_width_is_planned_with_it() -> None:
    """Qwen3 and GPT-OSS set head_dim apart from dim / n_heads: the shape took dim / n_heads (a reviewer:
    qwen3_30b_a3b's attention projections counted at half, its step time 24% short; nano with head_dim=64
    predicted 0.854 of the measured activations). Mutation: ModelShape.head_dim as dim // n_heads again."""
    from trainer.models.llama import Llama

    cfg = compose("pretrain", ["model=nano", "+model.head_dim=64"])
    shape = _inputs(cfg)[0]
    assert shape.head_dim == 64 != shape.dim // shape.n_heads
    assert shape.attention_width == shape.n_heads * 64
    model = Llama(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, head_dim=64)
    assert model.flops_per_token(10) - 6 * (4 * 32 * 128 + 3 * 32 * 64 + 32 * 64) == 12 * 128 * 10  # H x E wide


def test_every_k_checkpointing_counts_each_pp_ranks_own_blocks() -> None:
    """Under pp the plugin numbers the blocks its rank keeps; the planner took global indices:
    with k=2 and stage 1 at layers 3..7 it checkpointed 4 and 6 where the run checkpoints 3, 5 and 7."""
    import torch

    from strategies.activation_checkpoint import apply_activation_checkpointing
    from strategies.pipeline.stages import split_model
    from strategies.planner.layout import Layout, Workload
    from strategies.planner.memory import predict_rank
    from strategies.planner.ranks import checkpointed_layers, rank_of, stage_plan
    from strategies.planner.time import Cluster, layer_costs
    from trainer.models.llama import Llama

    def model() -> Llama:
        with torch.device("meta"):
            return Llama(vocab_size=64, dim=32, n_layers=8, n_heads=4, max_seq_len=16)

    shape, every_2 = ModelShape.from_model(model()), {"ac": "every_k", "ac_every_k": 2}
    split = Layout(pp=2, split_points=(3,), **every_2)
    for layout in (split, Layout(pp=2, stages_per_rank=2, pp_schedule="Interleaved1F1B", **every_2)):
        chosen = set()
        for pp_rank in range(layout.pp):
            stages, layers, _ = stage_plan(shape, layout, pp_rank)
            kept = model()
            split_model(kept, stages=stages, layers=layers)
            chosen |= set(map(int, apply_activation_checkpointing(kept, mode="every_k", every_k=2)))
        assert checkpointed_layers(shape, layout) == chosen, layout
    # Stage 1 (layers 3..7) keeps 3 block inputs and 2 whole blocks; block 3 is recomputed, 4 is not.
    work, rank = Workload(seq_len=16, global_batch_size=4), rank_of(split, pp=1)
    none, full, every = (
        predict_rank(shape, split.with_(ac=ac), work, rank).activations_per_microbatch
        for ac in ("none", "full", "every_k")
    )
    assert 5 * every == 2 * none + 3 * full
    blocks = layer_costs(shape, split, work, Cluster())[1]
    assert blocks[3] == blocks[0] > blocks[4] == blocks[1]  # 0 and 3: the first block of each rank
