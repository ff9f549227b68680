"""Expert parallelism in every layout it composes with equals one process running a mixture of
experts written here.

fp32, a 2-block MoE decoder (width 64, 4 experts of 32, top-2, one shared expert, every block MoE)
on packed 64-token rows, global batch 8, 3 steps of SGD with momentum. The router trains with the
sequence-wise balance loss (0.01), the z-loss (0.001) and the auxiliary-loss-free expert bias
(rate 0.01), so the per-row statistics, the step-wide normalisation of the router losses and the
bias update all have to agree across ranks. The reference is a plain loop with its own forward
(embedding, RMSNorm, GQA with RoPE on block-causal masks, dense top-k mixture with every expert
applied to every token and masked, LM head), its own router losses and its own bias update,
started from plait's initial weights. Compared within 1e-5: the loss and every gradient at each
step, and the parameters after the 3 steps; and the logged router statistics (``train/moe/...``: the
balance loss and z-loss per token, each expert's load) at each step, which pipeline stages (each its own
blocks) and context-parallel ranks (each part of every row) must add up as one process does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from harness import EXACT_SGD, MOE_SMALL, compose_config, fit, losses, reference_setup

from trainer.data.packing import IGNORE_INDEX

STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
BALANCE, ZLOSS, RATE = 0.01, 0.001, 0.01  # MOE_SMALL's router settings
COMMON = (
    *EXACT_SGD,
    *MOE_SMALL,
    f"trainer.max_steps={STEPS}",
    "+callbacks.grads._target_=harness.GradRecorder",
    "+callbacks.params._target_=harness.ParamRecorder",
)
LAYOUTS = {  # dp_shard fills the ranks the other degrees leave; ep borrows 2 of them
    "ep2": ["strategy=nd", "trainer.devices=2", "strategy.expert_parallel.ep=2", "train.micro_batch_size=2"],
    "ep2_x_fsdp2": ["strategy=nd", "trainer.devices=4", "strategy.expert_parallel.ep=2", "train.micro_batch_size=1"],
    "ep2_x_tp2": ["strategy=nd", "trainer.devices=4", "strategy.tp=2", "strategy.expert_parallel.ep=2",
                  "train.micro_batch_size=2"],
    # Compiled blocks (aot_eager): float32 experts run their loop there (torch 2.13's _grouped_mm
    # traces bfloat16 only; moe.grouped_mm_supported), tensor-parallel attention beside them.
    "ep2_x_tp2_compile_block": ["strategy=nd", "trainer.devices=4", "strategy.tp=2", "strategy.expert_parallel.ep=2",
                                "train.micro_batch_size=2", "strategy.compile.enabled=true",
                                "strategy.compile.backend=aot_eager"],
    "ep2_compile_block": ["strategy=nd", "trainer.devices=2", "strategy.expert_parallel.ep=2", "train.micro_batch_size=2",
                          "strategy.compile.enabled=true", "strategy.compile.backend=aot_eager"],
    "ep2_x_pp2": ["strategy=nd", "trainer.devices=4", "strategy.pp=2", "strategy.expert_parallel.ep=2",
                  "train.micro_batch_size=2"],
    "pp2": ["strategy=nd", "trainer.devices=2", "strategy.pp=2", "train.micro_batch_size=2"],
    # each cp rank holds part of every row: the sequence-wise balance loss counts the whole rows
    "cp2": ["strategy=cp", "trainer.devices=2", "train.micro_batch_size=4"],
    "llep2": ["strategy=nd", "trainer.devices=2", "strategy.expert_parallel.ep=2",
              "strategy.expert_parallel.least_loaded=true", "strategy.expert_parallel.min_tokens_per_gemm=1"],
}  # fmt: skip


# ---------------------------------------------------------------------------------------------- the reference
def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta=10000.0):
    half = x.shape[-1] // 2
    freqs = pos[..., None].float() / theta ** (torch.arange(half) / half)  # [B, T, E/2]
    cos, sin = freqs.cos()[:, :, None], freqs.sin()[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attention(x, P, i, pos, docs, heads=4, kv_heads=2):
    B, T, D = x.shape
    E = D // heads
    q = (x @ P[f"layers.{i}.attention.wq.weight"].T).view(B, T, heads, E)
    k = (x @ P[f"layers.{i}.attention.wk.weight"].T).view(B, T, kv_heads, E)
    v = (x @ P[f"layers.{i}.attention.wv.weight"].T).view(B, T, kv_heads, E)
    q, k = rope(q, pos), rope(k, pos)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(E)
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    attn = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhe->bqhe", attn, v).reshape(B, T, D) @ P[f"layers.{i}.attention.wo.weight"].T


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def mixture(x, P, i, bias, real, k=2):
    """Every expert on every token, masked by the top-k choice; returns (output, balance sum, z sum, loads).
    ``real`` [B, T]: 1 on real tokens, 0 on padding, which no statistic or router loss counts."""
    B, T, D = x.shape
    f = f"layers.{i}.feed_forward."
    logits = x @ P[f + "router.gate.weight"].T
    probs = logits.softmax(-1)  # [B, T, E]
    E = probs.shape[-1]
    chosen = (probs + bias).topk(k, dim=-1).indices
    mask = torch.zeros_like(probs).scatter(-1, chosen, 1.0)
    weights = probs * mask / (probs * mask).sum(-1, keepdim=True)
    out = sum(
        weights[..., e : e + 1] * swiglu(x, P[f + "experts.w1"][e], P[f + "experts.w2"][e], P[f + "experts.w3"][e])
        for e in range(E)
    )
    out = out + swiglu(x, *(P[f + f"shared_experts.{w}.weight"] for w in ("w1", "w2", "w3")))
    routed = mask * real[..., None]
    length = real.sum(1, keepdim=True).clamp(min=1)  # [B, 1]: the row's real tokens
    share = routed.sum(1) * E / (k * length)  # [B, E]: the row's routed share of each expert, times E/K
    balance = (share[:, None, :] * probs * real[..., None]).sum()
    z = (torch.logsumexp(logits, -1).square() * real).sum()
    return out, balance, z, routed.sum((0, 1))


def pretrain_batches(cfg) -> list[dict]:
    """The reference's global batches of the pretraining rows (no padding): `reference_setup`'s sampler."""
    rows, _, _, sampler = reference_setup(cfg)
    return [{k: getattr(rows, k)[index] for k in ("input_ids", "position_ids", "document_ids", "labels")}
            for _, index in zip(range(STEPS), sampler)]  # fmt: skip


def sft_batches(cfg) -> list[dict]:
    """The global batches of the SFT mixture, rows with pad tails (``source_ids`` -1), as one rank reads them."""
    from trainer.build import build_data

    batches = build_data(cfg).train_batches(0, 1)
    return [batch for _, (batch, _, _) in zip(range(STEPS), batches.batches(batches.start()))]


def reference(cfg, batches: list[dict]) -> dict:
    P = {n: p.detach().clone().requires_grad_() for n, p in _model(cfg).named_parameters()}
    biases = [torch.zeros(4) for _ in range(2)]
    optimizer = torch.optim.SGD(P.values(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    out = {"loss": [], "grads": [], "metrics": []}
    for batch in batches:
        ids, pos, docs, labels = (batch[k] for k in ("input_ids", "position_ids", "document_ids", "labels"))
        real = (batch["source_ids"] >= 0).float() if "source_ids" in batch else torch.ones(ids.shape)
        h = P["tok_embeddings.weight"][ids]
        router_loss, loads, balances, zs = 0.0, [], 0.0, 0.0
        for i in range(2):
            h = h + attention(rms(h, P[f"layers.{i}.attention_norm.weight"]), P, i, pos, docs)
            y, balance, z, load = mixture(rms(h, P[f"layers.{i}.ffn_norm.weight"]), P, i, biases[i], real)
            h, router_loss = h + y, router_loss + BALANCE * balance + ZLOSS * z
            loads.append(load)
            balances, zs = balances + balance.item(), zs + z.item()
        pairs = real.sum().item() * 2  # real token x block pairs: the statistics are means over them
        metrics = {"train/moe/balance_loss": balances / pairs, "train/moe/z_loss": zs / pairs}
        metrics |= {f"train/moe/load/{e}": (sum(loads)[e] * 4 / 2 / pairs).item() for e in range(4)}  # x E/K
        out["metrics"].append(metrics)
        logits = rms(h, P["norm.weight"]) @ P["output.weight"].T
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = ce / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        (loss + router_loss / real.sum()).backward()  # router losses: a mean over the step's real tokens
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.detach().clone() for n, p in P.items()})
        optimizer.step()
        for bias, load in zip(biases, loads):
            bias += RATE * torch.sign(load.mean() - load)
    out["params"] = {n: p.detach().clone() for n, p in P.items()}
    return out


def _model(cfg):
    """plait's initial weights for ``cfg`` (as `reference_setup` draws them)."""
    from trainer.build import build_data
    from trainer.model_node import instantiate_model

    vocab = build_data(cfg).prepare().tokenizer.vocab_size
    torch.manual_seed(cfg.seed)
    return instantiate_model(cfg.model, vocab_size=cfg.model.get("vocab_size") or vocab)


@pytest.fixture(scope="module")
def ref() -> dict:
    cfg = compose_config(COMMON)
    return reference(cfg, pretrain_batches(cfg))


# SFT rows of the synthetic mixture: samples whole in a row, pad tails of 0-24 tokens of 64; the
# tokenizer's 287 tokens padded to 288 for tp=2.
SFT = (
    "model=nano", "data=synthetic", "data.seq_len=64", "~data.sources.reversal", "data.sources.addition.limit=40",
    "data.sources.addition.val_size=4", "data.sources.sorting.limit=40", "data.sources.sorting.val_size=4",
    "data.sources.addition.metric=loss", "data.sources.sorting.metric=loss", "train.global_batch_size=8",
    "train.eval_every=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
    "strategy.timeout_s=120", "logger=none", "~callbacks.plots", "+model.vocab_size=288",
)  # fmt: skip


def _sft_config(overrides=()):
    return compose_config([*SFT, *COMMON, *overrides], recipe="sft", tiny=False)


@pytest.fixture(scope="module")
def ref_padded() -> dict:
    cfg = _sft_config()
    batches = sft_batches(cfg)
    assert all(bool((b["source_ids"] < 0).any()) for b in batches)  # every step has padding to leave out
    return reference(cfg, batches)


def _run(overrides: list[str], run_dir, *, padded: bool = False) -> dict:
    cfg = _sft_config(overrides) if padded else compose_config([*COMMON, *overrides])
    _, task = fit(cfg, run_dir)
    return {
        "loss": losses(task.history),
        "grads": [h["grads"] for h in task.history if "grads" in h],
        "params": [h["params"] for h in task.history if "params" in h][0],
        "metrics": [{k: v for k, v in h.items() if k.startswith("train/moe/")} for h in task.history if "loss" in h],
    }


def assert_equivalent(run: dict, expected: dict) -> None:
    assert len(run["loss"]) == len(run["grads"]) == STEPS
    for step in range(STEPS):
        torch.testing.assert_close(run["loss"][step], expected["loss"][step], **TOL, msg=f"loss at step {step + 1}")
        torch.testing.assert_close(run["grads"][step], expected["grads"][step], **TOL, msg=f"grads at step {step + 1}")
        assert run["metrics"][step] == pytest.approx(expected["metrics"][step], rel=1e-5, abs=1e-6), f"step {step + 1}"
    torch.testing.assert_close(run["params"], expected["params"], **TOL, msg=f"parameters after {STEPS} SGD steps")


def test_one_process_equals_the_reference(ref, tmp_path):
    assert_equivalent(_run(["train.micro_batch_size=4"], tmp_path), ref)


# The suite's budget: run with -m slow (the compiled experts: tests/unit/test_moe.py -k compiled by default).
SLOW = {"ep2_x_tp2", "ep2_compile_block", "ep2_x_tp2_compile_block", "ep2_x_pp2", "pp2"}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in LAYOUTS],
    ids=list(LAYOUTS),
)
def test_layout_equals_the_reference(layout, ref, tmp_path):
    assert_equivalent(_run(LAYOUTS[layout], tmp_path), ref)


# Rows with pad tails (SFT): the routers leave the padding out of their loads, losses and the
# step's normalisation, on ranks that hold different numbers of real tokens.
PADDED = {
    "one_process": ["train.micro_batch_size=4"],
    **{k: LAYOUTS[k] for k in ("ep2", "ep2_x_fsdp2", "llep2", "cp2", "ep2_x_tp2", "ep2_x_pp2", "ep2_compile_block")},
    # the recomputed forward of every block must be given the same mask
    "ep2_checkpointed": [*LAYOUTS["ep2"], "strategy.activation_checkpoint.mode=full"],
}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in PADDED],
    ids=list(PADDED),
)
def test_padded_rows_equal_the_reference(layout, ref_padded, tmp_path):
    assert_equivalent(_run(PADDED[layout], tmp_path, padded=True), ref_padded)
