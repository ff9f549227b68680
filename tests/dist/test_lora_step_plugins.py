"""LoRA under the step plugins and objectives: every adapter trains in every combination
`validate` accepts with ``+strategy/lora=default``, SAT + LoRA equals an independent reference, and
the one combination that cannot be honoured (an adapter on a tied LM head) is refused naming the fix.

An adapter lives in a forward hook on its linear layer, so code that multiplies by ``layer.weight``
itself skips it in silence: SAT's sliced MLP (``F.linear(x, w1.weight[idx])``) left every MLP
adapter's B at exactly 0, attention adapters training. Such paths now go through
`strategies.transforms.lora.linear_slice` / `linear_operands`; these tests hold every path to it.

Bases: random Hugging Face checkpoints written by transformers (`hf_checkpoints.make_hf_dir`): a
Llama 3, a Qwen3-MoE (a dense first block, routed experts in the second) and a tied Llama 2.

The SAT reference is written here: each target projection of the loaded Llama becomes
``F.linear(x, W + (alpha/r) B A)`` with its own A (drawn as `strategies.transforms.lora.apply_lora` documents:
one ``torch.Generator().manual_seed(0)``, uniform(-1/sqrt(in), 1/sqrt(in)) per target in module
order) and B = 0, and each MLP multiplies its hidden activation by the step's 0/1 channel mask
(the kept channels from plait's `kept_channels`: the draw is shared on purpose, the test checks
the omission of base and adapter alike); token-mean cross-entropy of the global batch, SGD with
momentum on the adapters. plait instead slices W's, B's rows (w1, w3) and A's columns (w2).
"""

from __future__ import annotations

import json
import math
import random
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import EXACT_SGD, compose_config, fit, recorded
from hf_checkpoints import make_hf_dir
from strategies.transforms.sat import kept_channels
from trainer.config import ConfigError, validate

STEPS = 3
RANK, ALPHA = 4, 8.0
RATE, SAT_SEED = 0.5, 5
TOL = {"rtol": 1e-5, "atol": 1e-5}
TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
SAT = ("+strategy/sat=default", f"strategy.sat.rate={RATE}", f"strategy.sat.seed={SAT_SEED}", "strategy.sat.ladder=null")
HEAD = ("strategy.lora.target_modules=[wq,wk,wv,wo,w1,w2,w3,output]",)  # the LM head adapted too
CHUNKED = ("objective.loss_chunk_tokens=16", *HEAD)  # the chunked loss applies the head's weight itself
_RUN = (
    "train.global_batch_size=8", "train.eval_every=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
    "strategy.timeout_s=120", "logger=none", "~callbacks.plots", "~callbacks.checkpoint", *EXACT_SGD,
    "+strategy/lora=default", f"strategy.lora.rank={RANK}", f"strategy.lora.alpha={ALPHA}",
    "+callbacks.grads._target_=harness.GradRecorder", "+callbacks.params._target_=harness.ParamRecorder",
)
_SFT = (
    "data=synthetic", "data.seq_len=96", "~data.sources.reversal", "data.sources.addition.limit=24",
    "data.sources.addition.val_size=4", "data.sources.sorting.limit=24", "data.sources.sorting.val_size=4",
    "data.sources.addition.metric=loss", "data.sources.sorting.metric=loss",
)
_PREFERENCE = (
    "data=preference_synthetic", "data.seq_len=48", "data.max_prompt_len=24", "data.sources.copy.limit=24",
    "data.sources.copy.val_size=4",
)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bases")
    for family, name in (("llama3", "llama"), ("qwen3_moe", "moe"), ("llama2", "tied")):
        make_hf_dir(family, root / name)
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))}) for _ in range(400)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _config(bases, recipe: str, base: str, overrides) -> object:
    data = {"pretrain": (f"data.path={bases / 'docs.jsonl'}", "data.seq_len=64", "data.eval_rows=8"), "sft": _SFT}.get(recipe, _PREFERENCE)
    common = ("model=hf", f"model.init_from={bases / base}", *data, *_RUN)
    return compose_config([*common, *overrides], recipe=recipe, tiny=False)


# combination id -> (recipe, base, overrides): the step plugins (SAT, Mixout), the chunked loss
# over an adapted head, QLoRA's 4-bit base under both weight-reading paths, the MoE model, every
# objective family, and FSDP2 (whose gathered parameters the weight-reading paths read).
COMBINATIONS = {
    "lora": ("pretrain", "llama", ()),
    "sat": ("pretrain", "llama", SAT),
    "mixout": ("pretrain", "llama", ("+strategy/mixout=default",)),
    "chunked_head": ("pretrain", "llama", CHUNKED),
    "sat_mixout_chunked_head_ga2": ("pretrain", "llama", (*SAT, "+strategy/mixout=default", *CHUNKED, "train.micro_batch_size=4")),
    "qlora_sat_chunked_head": ("pretrain", "llama", (*SAT, *CHUNKED, "strategy.lora.quantize=nf4")),
    "moe_sat": ("pretrain", "moe", SAT),
    "sft_sat": ("sft", "llama", SAT),
    "dpo_sat_mixout": ("dpo", "llama", (*SAT, "+strategy/mixout=default")),
    "kto_sat": ("kto", "llama", SAT),
    "fsdp2_sat_chunked_head": ("pretrain", "llama", (*SAT, *CHUNKED, "strategy=fsdp", "trainer.devices=2")),
}


@pytest.mark.parametrize("combo", list(COMBINATIONS))
def test_every_adapter_gets_a_gradient(bases, tmp_path, combo):
    """Step 2 (B moved at step 1, so A's gradient is non-zero too): every lora_A and lora_B has a
    non-zero gradient, and nothing else has one."""
    recipe, base, overrides = COMBINATIONS[combo]
    cfg = _config(bases, recipe, base, [*overrides, "trainer.max_steps=2"])
    validate(cfg)  # accepted
    _, task = fit(cfg, tmp_path)
    run = recorded(task.history)
    adapters = {n for n in run["params"] if ".lora_" in n}
    assert any(".feed_forward." in n for n in adapters) and any(".attention." in n for n in adapters), sorted(adapters)
    if "head" in combo:
        assert {"output.lora_A.weight", "output.lora_B.weight"} <= adapters
    assert len(run["grads"]) == 2
    grads = run["grads"][-1]
    assert set(grads) == adapters, f"without a gradient: {sorted(adapters - set(grads))}; not adapters: {sorted(set(grads) - adapters)}"
    dead = sorted(n for n, g in grads.items() if not g.abs().sum() > 0)
    assert not dead, f"{len(dead)} adapters got a zero gradient at step 2: {dead}"


def test_an_adapter_on_a_tied_head_is_refused(bases):
    cfg = _config(bases, "pretrain", "tied", HEAD)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert any(
        "selects the output head, whose weight is the input embedding's" in p and "leave 'output' out of strategy.lora.target_modules" in p
        for p in err.value.problems
    ), err.value.problems
    validate(_config(bases, "pretrain", "tied", ()))  # the default targets leave the tied head alone


# ---------------------------------------------------------------------------------------------- SAT + LoRA == reference
class RefLoRA(nn.Module):
    """y = x (W + (alpha / r) B A)^T: the test's own adapted layer, one matmul on the merged weight."""

    def __init__(self, base: nn.Linear, a: torch.Tensor) -> None:
        super().__init__()
        self.weight = base.weight  # frozen
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(torch.zeros(base.out_features, a.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight + (ALPHA / RANK) * self.B @ self.A)


def _masked_mlp(ff: nn.Module, mask_f: list[torch.Tensor]):
    def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_btd)) * self.w3(x_btd) * mask_f[0])

    return types.MethodType(forward, ff)


def _reference(cfg, base_dir) -> dict:
    from trainer.model_node import instantiate_model

    from trainer.build import build_data
    from trainer.data.packing import IGNORE_INDEX
    from trainer.data.sampler import GlobalBatchSampler
    from trainer.models.hf import load_hf_weights

    prepared = build_data(cfg).prepare()
    rows = prepared.train
    model = instantiate_model(cfg.model, vocab_size=prepared.tokenizer.vocab_size)
    load_hf_weights(model, base_dir)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    adapters: dict[str, RefLoRA] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in TARGETS:
            bound = 1 / math.sqrt(module.in_features)
            a = torch.empty(RANK, module.in_features).uniform_(-bound, bound, generator=generator)
            parent, _, leaf = name.rpartition(".")
            adapters[name] = RefLoRA(module, a)
            setattr(model.get_submodule(parent), leaf, adapters[name])
    masks = {i: [torch.ones(block.feed_forward.ffn_dim)] for i, block in model.layers.items()}
    for i, block in model.layers.items():
        block.feed_forward.forward = _masked_mlp(block.feed_forward, masks[i])
    optimizer = torch.optim.SGD([p for m in adapters.values() for p in (m.A, m.B)], lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    sampler = GlobalBatchSampler(len(rows), global_batch_size=8, dp_size=1, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    out = {"loss": [], "grads": [], "base": base}
    for step, index in zip(range(STEPS), sampler):
        for i, block in model.layers.items():
            ffn_dim = block.feed_forward.ffn_dim
            kept = kept_channels(ffn_dim, RATE, seed=SAT_SEED, step=step, name=f"layers.{i}.feed_forward")
            masks[i][0] = torch.zeros(ffn_dim).index_fill_(0, kept, 1.0)
        labels = rows.labels[index]
        logits = model(rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index])
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append(_plait_names({n: (m.A.grad.clone(), m.B.grad.clone()) for n, m in adapters.items()}))
        optimizer.step()
    out["adapters"] = _plait_names({n: (m.A.detach().clone(), m.B.detach().clone()) for n, m in adapters.items()})
    return out


def _plait_names(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{n}.lora_{k}.weight": t for n, (a, b) in pairs.items() for k, t in (("A", a), ("B", b))}


LAYOUTS = {
    "one_process_ga2": ("train.micro_batch_size=4",),
    "fsdp2": ("strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"),
}


@pytest.fixture(scope="module")
def sat_reference(bases) -> dict:
    return _reference(_config(bases, "pretrain", "llama", (*SAT, f"trainer.max_steps={STEPS}")), bases / "llama")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sat_lora_equals_a_masked_merged_weight_reference(bases, sat_reference, tmp_path, layout):
    cfg = _config(bases, "pretrain", "llama", (*SAT, f"trainer.max_steps={STEPS}", *LAYOUTS[layout]))
    _, task = fit(cfg, tmp_path)
    run, ref = recorded(task.history), sat_reference
    torch.testing.assert_close(run["loss"], ref["loss"], **TOL, msg="losses")
    for step, (got, expected) in enumerate(zip(run["grads"], ref["grads"], strict=True), 1):
        assert set(got) == set(expected), "only the adapters have gradients"
        torch.testing.assert_close(got, expected, **TOL, msg=f"adapter gradients at step {step}")
    assert all(g.abs().sum() > 0 for n, g in run["grads"][-1].items() if ".feed_forward." in n), "the MLP adapters train"
    for name, weight in ref["base"].items():
        assert torch.equal(run["params"][name], weight), f"{name}: the base changed"
    torch.testing.assert_close({n: run["params"][n] for n in ref["adapters"]}, ref["adapters"], **TOL, msg="adapters after the steps")
