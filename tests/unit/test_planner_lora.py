"""The planner on LoRA and QLoRA runs (``+strategy/lora=default``): a frozen base without gradients
or optimizer state, trained adapters, QLoRA's 4-bit base; against the tensors a LoRA model really
holds on one process (`strategies.planner.measure.storage_bytes`, as tests/dist/test_planner_memory.py
measures them per rank)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from strategies.mesh import build_strategy
from strategies.planner.layout import Layout
from strategies.planner.measure import SavedTensorBytes, storage_bytes
from strategies.planner.memory import predict_rank, state_bytes
from strategies.planner.search import SearchSpace, candidate_layouts
from strategies.planner.time import Cluster, predict_time
from strategies.transforms.qlora import BLOCKSIZE
from trainer.build import build_model
from trainer.compose import compose
from trainer.config import validate
from trainer.optim import build_optimizer
from trainer.planning import planner_inputs

# Adapters on every attention projection and on block 1's MLP only: a glob that tells alike blocks apart.
LORA = ["model=nano", "+strategy/lora=default", "strategy.lora.target_modules=[wq,wk,wv,wo,layers.1.feed_forward.*]"]
ROWS, SEQ = 2, 32


def _planned(*overrides: str):
    """(cfg, run, shape, layout, workload) of nano with LoRA, one process, 2 rows of 32 tokens."""
    cfg = compose("pretrain", [*LORA, f"data.seq_len={SEQ}", f"train.global_batch_size={ROWS}", *overrides])
    run = validate(cfg, for_launch=False)
    return (cfg, run, *planner_inputs(cfg, run))


def _adapted(cfg, run) -> torch.nn.Module:
    model = build_model(cfg, run, vocab_size=run.shape.vocab_size)
    build_strategy(cfg.strategy, run=run).plugins["lora"].attach(model)
    return model


def _loss(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_lora_state_is_what_the_adapted_model_holds(optim: str) -> None:
    """A reviewer's 8B LoRA SFT on one device was refused by planner.check at 124 GiB: the planner
    counted a full fine-tune (gradients and AdamW state for every weight). Here nano's parameters,
    gradients and optimizer state after one step are exactly the predicted bytes."""
    cfg, run, shape, layout, work = _planned(f"optim={optim}")
    assert work.lora is not None and len(work.lora.targets) == 2 * 4 + 3
    model = _adapted(cfg, run)
    optimizer = build_optimizer(model, run.optimizer, weight_decay=0.1)
    _loss(model, shape.vocab_size).backward()
    optimizer.step()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = storage_bytes(params), storage_bytes(p.grad for p in params if p.grad is not None), storage_bytes(state)
    assert state_bytes(shape, layout, work, 0) == held
    full = state_bytes(shape, layout, replace(work, lora=None), 0)
    assert full[0] < held[0] and full[1] > 10 * held[1] and full[2] > 10 * held[2]


def test_lora_activations_add_each_adapters_rank_wide_output() -> None:
    """B keeps A's output, r features a token per adapted layer: a rank-16 run saves exactly the
    predicted bytes more than a rank-8 one. The prediction still counts what a frozen base no longer
    needs (the norms' normalised input, the token ids, a frozen layer's input that no adapter
    reads), so it bounds the measured bytes from above."""
    measured, predicted = {}, {}
    for rank in (8, 16):
        cfg, run, shape, layout, work = _planned(f"strategy.lora.rank={rank}")
        model = _adapted(cfg, run)
        with SavedTensorBytes(model) as saved:
            _loss(model, shape.vocab_size)
        measured[rank] = saved.bytes
        predicted[rank] = predict_rank(shape, layout, work, 0, device="cpu").activations_per_microbatch
    assert predicted[16] - predicted[8] == measured[16] - measured[8] == ROWS * SEQ * 11 * 8 * 4
    assert measured[8] < predicted[8] < 1.25 * measured[8]


def test_qlora_keeps_its_base_in_four_bits() -> None:
    """QLoRA (strategy.lora.quantize=nf4) keeps each adapted weight as NF4 codes in float32 storage,
    [out * in / 8, 1] (strategies/transforms/qlora.py), sharded by FSDP2 like any parameter, and
    its absmax (one float32 per 64 weights) and 16-entry float32 code book whole on every rank;
    adapters, gradients and optimizer state as LoRA's."""
    _, _, shape, _, lora = _planned()
    qlora = replace(lora, lora=replace(lora.lora, quantize="nf4"))
    adapted = [p for p in shape.params if lora.lora.adapts(p)]
    for layout in (Layout(), Layout(dp_shard=4)):
        shards = layout.dp_shard
        base = sum(math.prod(p.shape) for p in adapted)  # fp32: 4 bytes a weight, exactly divisible here
        codes = sum(-(-math.prod(p.shape) // 8 // shards) * 4 for p in adapted)
        stats = sum(math.prod(p.shape) // BLOCKSIZE * 4 + 64 for p in adapted)
        float_base, four_bit = (state_bytes(shape, layout, w, 0) for w in (lora, qlora))
        assert four_bit[0] == float_base[0] - 4 * base // shards + codes + stats
        assert four_bit[1:] == float_base[1:]
    assert predict_rank(shape, Layout(), qlora, 0).total < predict_rank(shape, Layout(), lora, 0).total


def test_lora_step_time_reduces_and_updates_the_adapters_only() -> None:
    """Under LoRA the optimizer streams the adapters only, FSDP gathers the whole (frozen) model but
    reduce-scatters only the adapters' gradients, and the frozen weights' backward skips their
    weight gradients (one forward's worth of the matmuls)."""
    cfg = compose("pretrain", ["model=llama3_8b", "+strategy/lora=default", "train.global_batch_size=8"])
    shape, _, lora = planner_inputs(cfg, validate(cfg, for_launch=False))
    full, layout = replace(lora, lora=None), Layout(dp_shard=8)
    cluster = Cluster(cores=64)  # nothing hides under compute: the collectives' own time
    with_lora, without = predict_time(shape, layout, lora, cluster), predict_time(shape, layout, full, cluster)
    assert with_lora.optimizer < without.optimizer / 50
    # One micro-batch: fp32 weights gathered twice (forward, backward), fp32 gradients reduced once.
    assert with_lora.fsdp_comm / without.fsdp_comm == pytest.approx(8 / 12, rel=0.01)
    # Matmuls: 3 forwards' worth -> 2 (and the adapters'); attention and elementwise work unchanged.
    assert 0.6 < with_lora.compute / without.compute < 0.9


def test_a_lora_plan_tries_only_the_layouts_lora_runs() -> None:
    """plait plan model=llama3_8b cluster=h100x8 +strategy/lora=default listed pipeline layouts, which
    LoRA refuses (and QLoRA tensor-parallel ones): 513 of its 753 layouts had pp > 1."""
    cfg = compose("pretrain", ["model=llama3_8b", "cluster=h100x8", "+strategy/lora=default"])
    shape, _, lora = planner_inputs(cfg, validate(cfg, for_launch=False))
    cluster, space = Cluster(), SearchSpace()
    layouts = list(candidate_layouts(shape, lora, cluster, space))
    assert layouts and all(x.pp == 1 for x in layouts) and any(x.tp > 1 for x in layouts)
    qlora = replace(lora, lora=replace(lora.lora, quantize="nf4"))
    assert all(x.pp == x.tp == 1 for x in candidate_layouts(shape, qlora, cluster, space))
    assert any(x.pp > 1 for x in candidate_layouts(shape, replace(lora, lora=None), cluster, space))
