"""The planner's memory model against the bytes the layouts really hold.

Each layout trains the nano Llama for 2 steps (AdamW, fp32, packed 64-token rows with document
masks, global batch 8) in forked gloo ranks with `MemoryProbe`, which measures on every rank in
the second step: the storages of parameters, gradients (before the optimizer step) and optimizer
state (after it), and the tensors autograd saves for backward per micro-batch
(``saved_tensors_hooks``). The planner predicts the same figures per rank from the config alone
(``strategies.planner``); two of them with QK-norm (OLMo 2 under tp, a Qwen3-style nano under
FSDP), two Gemma 3 (sandwich norms, a windowed block, a tied head under tp), two DeepSeek-V3 (latent
attention, whole on each rank under tp with AdamW's groups split by tensor kind; a dense first
block, shared and group-routed experts). Two GPT-OSS (sinks sharded by head under tp, q/k/v/o biases, biased clamped-SwiGLU experts). Two local-SGD
layouts (DiLoCo's anchors and outer momentum, DASO's message in flight: counted with the optimizer's state). Parameters, gradients and optimizer state must match exactly;
activations within 5% (the batch's id and label tensors are shared by its micro-batches); FSDP's
gathered parameters when the backward starts exactly where every block stays gathered
(``reshard_after_forward=false``), else at most the planner's two blocks and root.
"""

from __future__ import annotations

import json

import pytest
from harness import MOE_SMALL, compose_config, fit
from hf_checkpoints import make_hf_dir

from strategies.planner.memory import gathered_bytes, predict_rank
from trainer.config import validate
from trainer.planning import planner_inputs

OLMO2_SMALL = ("model=olmo2_tiny", "model.dim=64", "model.n_heads=4", "model.n_layers=2", "model.max_seq_len=64")
GEMMA3_SMALL = (
    *("model=gemma3_tiny", "model.dim=64", "model.n_heads=4", "model.n_layers=2", "model.max_seq_len=64"),
    *("model.query_pre_attn_scalar=16", "model.window_layers=[0]", "model.sliding_window=16"),
)
DSV3_SMALL = (
    *("model=deepseek_v3_tiny", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=4", "model.n_layers=2"),
    *("model.max_seq_len=64", "model.ffn_dim=128", "model.moe_ffn_dim=32"),
)
GPT_OSS_SMALL = (
    *("model=gpt_oss_tiny", "model.dim=64", "model.n_heads=4", "model.head_dim=16", "model.n_layers=2"),
    *("model.max_seq_len=64", "model.moe_ffn_dim=32", "model.window_layers=[0]", "model.sliding_window=16"),
)
FSDP_NO_RESHARD = ("model.n_layers=4", "strategy.fsdp.reshard_after_forward=false")
PROBE = ("+callbacks.mem._target_=strategies.planner.measure.MemoryProbe", "trainer.max_steps=2")
# id -> (overrides, micro-batch forwards per rank per step)
LAYOUTS = {
    "ddp2": (["strategy=ddp", "trainer.devices=2", "train.micro_batch_size=4"], 1),
    "fsdp2": (["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"], 2),
    "fsdp4": (["strategy=fsdp", "trainer.devices=4", "train.micro_batch_size=2"], 1),
    # ZeRO-2: every block stays gathered from its forward to its backward (4 blocks, 2 gathered by default)
    "fsdp2_no_reshard": (
        [*FSDP_NO_RESHARD, "strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"],
        2,
    ),
    "tp2": (["strategy=tp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
    # bf16 autocast over fp32 weights: each matmul's bf16 weight copy is saved for the backward (the
    # planner had gathered bf16 and copied nothing: 8-18% low), FSDP without a policy gathers fp32
    "bf16_mixed1": (["trainer.precision=bf16-mixed", "train.micro_batch_size=8"], 1),
    "fsdp2_bf16_mixed": (
        ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2", "trainer.precision=bf16-mixed"],
        2,
    ),
    # a tied head's copy is the embedding's; local SGD's islands gather nothing across dp_replicate
    "gemma3_bf16_mixed1": ([*GEMMA3_SMALL, "trainer.precision=bf16-mixed", "train.micro_batch_size=8"], 1),
    "diloco2_bf16_mixed": (
        [
            *("strategy=diloco", "strategy.dp_shard=1", "strategy.local_sgd.sync_every=1", "trainer.devices=2"),
            *("train.micro_batch_size=4", "trainer.precision=bf16-mixed", "strategy.fsdp.param_dtype=bf16"),
        ],
        1,
    ),
    # fp16 weights (planned as fp32: model state twice its size)
    "fp16_true1": (["trainer.precision=16-true", "optim.eps=1e-4", "train.micro_batch_size=8"], 1),
    "pp2": (["strategy=pp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
    "cp2": (["strategy=cp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
    # a mixture of experts: its routed rows are top_k x tokens exactly without expert parallelism
    # QK-norm: OLMo 2's over whole projections (its mean of squares across the tp ranks), Qwen3's per head
    "olmo2_tp2": ([*OLMO2_SMALL, "strategy=tp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
    "qk_norm_fsdp2": (["+model.qk_norm=true", "strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"], 2),
    # Gemma 3: sandwich norms, a windowed first block (16 of 64 tokens: its mask), a tied head under tp
    "gemma3_fsdp2": ([*GEMMA3_SMALL, "strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"], 2),
    "gemma3_tp2": ([*GEMMA3_SMALL, "strategy=tp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
    "moe_fsdp2": ([*MOE_SMALL, "strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"], 2),
    # DeepSeek-V3: latent attention (interleaved rotated pairs; whole on each rank under tp), a dense
    # first block, shared and group-routed experts
    "deepseek_v3_fsdp2": ([*DSV3_SMALL, "strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"], 2),
    "deepseek_v3_tp2": ([*DSV3_SMALL, "strategy=tp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
    # GPT-OSS: sinks (their scores written out), q/k/v/o biases (wo's replicated under tp), a windowed
    # first block, experts with biases and the clamped SwiGLU
    "gpt_oss_fsdp2": ([*GPT_OSS_SMALL, "strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"], 2),
    "gpt_oss_tp2": ([*GPT_OSS_SMALL, "strategy=tp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
    # local SGD, 2 islands of FSDP over 2 ranks: DiLoCo's anchors and outer momentum (an outer step after
    # every step, so the momentum exists at the measured one), DASO's bf16 message in flight (delay 1)
    "diloco2x2": (
        [
            "strategy=diloco",
            "strategy.dp_shard=2",
            "strategy.local_sgd.sync_every=1",
            "trainer.devices=4",
            "train.micro_batch_size=2",
        ],
        1,
    ),
    "daso2x2": (
        [
            "strategy=hierarchical",
            "strategy.local_sgd.sync_every=1",
            "strategy.local_sgd.delay=1",
            "strategy.local_sgd.global_dtype=bf16",
            "trainer.devices=4",
            "train.micro_batch_size=2",
        ],
        1,
    ),
}


# The MoE prediction is within 2.6e-5 of the measured bytes; a dense feed-forward term in place of
# the MoE one is off by 4.4%, so the MoE layout is held to 1%.
TOLERANCE = {"moe_fsdp2": 0.01}
# With QK-norm the prediction is within 0.1%; without its saved tensors it was 5.2% (OLMo 2) and
# 5.3% (Qwen3-style) low, so these are held to 1% as well.
TOLERANCE.update(olmo2_tp2=0.01, qk_norm_fsdp2=0.01)
# Gemma 3 within 0.4%; without the two extra norms of its sandwich and its window mask it was 7.5% low.
TOLERANCE.update(gemma3_fsdp2=0.01, gemma3_tp2=0.01)
# GPT-OSS within 0.4%; without the written-out sink attention's and the clamped SwiGLU's saved tensors
# it was 13.0% (fsdp2) and 14.0% (tp2) low.
TOLERANCE.update(gpt_oss_fsdp2=0.01, gpt_oss_tp2=0.01)
# DeepSeek-V3 within 0.3% (its CPU attention is SDPA's math kernel: values narrower than keys); with
# grouped-query attention's q, k, v, out in place of latent attention's tensors it was 25% low.
TOLERANCE.update(deepseek_v3_fsdp2=0.01, deepseek_v3_tp2=0.01)


def _measured_and_predicted(cfg, tmp_path, microbatches: int):
    """Fits ``cfg`` (with `MemoryProbe`) and returns the planner's inputs and every rank's
    ``(rank, measured, predicted)``, after asserting that parameters, gradients and optimizer state
    match exactly."""
    fit(cfg, tmp_path)
    shape, layout, work = planner_inputs(cfg, validate(cfg))
    assert work.microbatches(layout) == microbatches
    ranks = []
    for rank in range(layout.world_size):
        measured = json.loads((tmp_path / f"memory_rank{rank}.json").read_text())
        predicted = predict_rank(shape, layout, work, rank, device="cpu")
        assert (predicted.params, predicted.grads, predicted.optimizer) == (
            measured["params"],
            measured["grads"],
            measured["optimizer"],
        ), (rank, predicted, measured)
        ranks.append((rank, measured, predicted))
    return (shape, layout, work), ranks


# Slow: 20 layouts in gloo ranks (~30 s); the planner's arithmetic is in tests/unit/test_planner.py.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_bytes_match_measured(name, tmp_path):
    overrides, microbatches = LAYOUTS[name]
    cfg = compose_config([*PROBE, f"+callbacks.mem.num_microbatches={microbatches}", *overrides])
    (shape, layout, work), ranks = _measured_and_predicted(cfg, tmp_path, microbatches)
    for rank, measured, predicted in ranks:
        gathered = gathered_bytes(shape, layout, work, list(range(shape.n_layers)))
        if gathered and layout.tp == layout.pp == 1:  # FSDP's gathered parameters (measured without tp)
            if layout.reshard_after_forward:  # the last block and the root (the planner: two blocks and the root)
                assert 0 < measured["gathered"] <= gathered, (rank, measured["gathered"], gathered)
            else:
                assert measured["gathered"] == gathered, (rank, measured["gathered"], gathered)
        error = abs(predicted.activations_per_microbatch / measured["activations"] - 1)
        assert error < TOLERANCE.get(name, 0.05), (rank, predicted.activations_per_microbatch, measured["activations"])


# LoRA on a random Llama-3 base (its adapters on every projection; planner-side: tests/unit/test_planner_lora.py):
# the frozen base has no gradients and no optimizer state. A frozen base saves less than the planner
# counts (the norms' normalised inputs, the token ids), so its activations are an upper bound.
LORA_LAYOUTS = {
    "lora_fsdp2": (["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"], 2),
    "lora_tp2": (["strategy=tp", "trainer.devices=2", "train.micro_batch_size=4"], 2),
}


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora_base") / "hf"
    make_hf_dir("llama3", directory)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_bytes_match_measured(name, hf_base, tmp_path):
    overrides, microbatches = LORA_LAYOUTS[name]
    cfg = compose_config(
        [
            *PROBE,
            f"+callbacks.mem.num_microbatches={microbatches}",
            "model=hf",
            f"model.init_from={hf_base}",
            "+strategy/lora=default",
            *overrides,
        ]
    )
    (_, _, work), ranks = _measured_and_predicted(cfg, tmp_path, microbatches)
    assert work.lora is not None
    for rank, measured, predicted in ranks:
        ratio = predicted.activations_per_microbatch / measured["activations"]
        assert 1 <= ratio < 1.25, (rank, predicted.activations_per_microbatch, measured["activations"])
