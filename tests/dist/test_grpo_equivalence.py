"""GRPO under DDP and FSDP2 (2 gloo ranks each) equals one process on the same rollouts, and every
layout equals a plain PyTorch loop whose rollout rows, rewards, advantages and clipped ratio loss
are written here.

The rollouts come from `rl_fixtures.ScriptedEngine`: a completion depends on its seed alone
(`trainer.rl.rollout.completion_seed` of the run's seed, the rollout, the prompt's index and the
sample), never on the model or on the rank that samples it, so the loop here asks the engine for
the very completions every layout trains on. Everything after the engine is written out: the
reward (`trainer.rl.rewards.length_penalty`'s formula, limit 3 characters, so the rewards vary
within a group), the group advantages (mean and Bessel-corrected std + 1e-4, TRL's; no std for
``dr_grpo``), the right-padded rows and their shifted labels, the token log-probs, the old
log-probs kept from each rollout's first step, the clipped ratio loss and its aggregation (``grpo``: mean over rows
of each row's token mean; ``dr_grpo``: token sum over rows x ``max_new_tokens``; ``dapo``: token
sum over the step's completion tokens, every rank's).

fp32, nano Llama, 64 addition prompts, 4 prompts x G=4 completions per step (16 rows), 4 steps
of SGD with momentum 0.9 (lr 0.1 or 0.5, constant; no clipping) and ``num_iterations=2``: steps 2 and 4
reuse their rollout, where the ratio leaves [1 - epsilon, 1 + epsilon_high] for some tokens (the
clip acts; asserted on plait's ``train/clip_ratio/region``). Compared: every step's loss and the
parameters after 4 steps, within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from rl_fixtures import ScriptedEngine
from trainer.model_node import instantiate_model

from harness import compose_config, fit, losses
from trainer.build import build_data
from trainer.data.sampler import GlobalBatchSampler
from trainer.rl.engine import SamplingParams
from trainer.rl.rollout import completion_seed

STEPS = 4
LIMIT = 3  # length_penalty's limit: completions of 0 to 6 characters score 0 down to -1
TOL = {"rtol": 1e-5, "atol": 1e-5}
COMMON = (
    "model=nano", "+model.vocab_size=272", "data.sources.addition.limit=64", "data.sources.addition.val_size=0",
    "data.seq_len=40", "objective.max_new_tokens=6", "objective.num_generations=4", "objective.num_iterations=2",
    "~objective.engine", "+objective.engine={_target_:rl_fixtures.ScriptedEngine}",
    "data.rewards.answer.fn._target_=trainer.rl.rewards.length_penalty", f"+data.rewards.answer.fn.limit={LIMIT}",
    "train.global_batch_size=16", "train.eval_every=0", "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false", "strategy.timeout_s=120", "logger=none", "~callbacks.plots",
    "~callbacks.checkpoint", "optim=sgd", "scheduler=constant", "scheduler.warmup_steps=0",
    "train.max_grad_norm=0", f"trainer.max_steps={STEPS}", "+callbacks.params._target_=harness.ParamRecorder",
)  # fmt: skip
LAYOUTS = {
    "one_process": ["train.micro_batch_size=8"],  # 2 micro-batches: accumulation
    "ddp": ["trainer.devices=2", "train.micro_batch_size=4"],  # 8 rows per rank in 2 micro-batches
    "fsdp2": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=8"],
}
# The presets of conf/objective/: grpo (a mean over rows of each row's token mean), dr_grpo (no std
# scaling; a token sum over rows x max_new_tokens) and dapo (asymmetric clip; a token sum over the
# step's completion tokens, every rank's: the divisor a rank cannot know alone); each with an SGD
# lr that takes some tokens' ratios, not all, out of the clip range by the rollout's second step.
OBJECTIVES = {"grpo": 0.1, "dr_grpo": 0.5, "dapo": 0.1}


def _cfg(objective, overrides):
    overrides = [f"objective={objective}", *COMMON, f"optim.lr={OBJECTIVES[objective]}", *overrides]
    return compose_config(overrides, recipe="grpo", tiny=False)


def _rollout(cfg, engine, items, tokenizer, indices, rollout):
    """``(input_ids, labels, advantages)`` of one rollout of the prompts at ``indices``, written out."""
    G, obj = cfg.objective.num_generations, cfg.objective
    prompts = [items[i].ids for i in indices for _ in range(G)]
    seeds = [completion_seed(obj.seed, rollout, i, g) for i in indices for g in range(G)]
    completions = engine.generate(
        None, prompts, params=SamplingParams(obj.max_new_tokens), eos_id=tokenizer.eos_id, seeds=seeds, all_done=None
    )
    texts = [tokenizer.decode(c[:-1] if c[-1] == tokenizer.eos_id else c) for c in completions]
    rewards = torch.tensor([-max(0, len(t) - LIMIT) / LIMIT for t in texts]).view(-1, G)
    advantages = rewards - rewards.mean(1, keepdim=True)
    if obj.scale_rewards == "group":
        advantages = advantages / (rewards.std(1, keepdim=True) + 1e-4)  # torch.std: Bessel-corrected
    input_ids = torch.full((len(prompts), cfg.data.seq_len), tokenizer.pad_id)
    labels = torch.full((len(prompts), cfg.data.seq_len), -100)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = prompt + completion
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt) - 1 : len(ids) - 1] = torch.tensor(completion)  # labels[t] = ids[t + 1]
    return input_ids, labels, advantages.flatten()


def _token_logps(model, input_ids, labels):
    logp = torch.log_softmax(model(input_ids).float(), -1)
    return torch.gather(logp, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def _reference(objective) -> dict:
    cfg = _cfg(objective, [])
    obj = cfg.objective
    low, high = obj.epsilon, obj.epsilon if obj.epsilon_high is None else obj.epsilon_high
    prepared = build_data(cfg).prepare()
    items, tokenizer, engine = prepared.train, prepared.tokenizer, ScriptedEngine()
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    prompts_per_step = cfg.train.global_batch_size // obj.num_generations
    sampler = iter(
        GlobalBatchSampler(len(items), global_batch_size=prompts_per_step, dp_size=1, shuffle=True, seed=cfg.data.seed)
    )
    out = {"loss": [], "advantages": [], "units": []}
    for step in range(STEPS):
        if step % obj.num_iterations == 0:  # a new rollout: sampled, scored, its log-probs kept
            rows = _rollout(cfg, engine, items, tokenizer, next(sampler), step // obj.num_iterations)
            input_ids, labels, advantages = rows
            with torch.no_grad():
                old = _token_logps(model, input_ids, labels)
            out["advantages"].append(advantages)
        mask = labels != -100
        ratio = torch.exp(torch.where(mask, _token_logps(model, input_ids, labels) - old, 0.0))
        adv = advantages.unsqueeze(-1)
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv) * mask
        if obj.loss_type == "grpo":
            loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        elif obj.loss_type == "dr_grpo":
            loss = per_token.sum() / (len(per_token) * obj.max_new_tokens)
        else:
            loss = per_token.sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        out["loss"].append(loss.item())
        out["units"].append(float(mask.sum() if obj.loss_type == "dapo" else len(mask)))  # the loss's divisor
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {objective: _reference(objective) for objective in OBJECTIVES}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_grpo_layout_matches_plain_loop(objective, layout, references, tmp_path):
    reference = references[objective]
    assert all((a != 0).sum() > len(a) // 2 for a in reference["advantages"])  # the rewards vary within groups
    _, task = fit(_cfg(objective, LAYOUTS[layout]), tmp_path)
    torch.testing.assert_close(torch.tensor(losses(task.history)), torch.tensor(reference["loss"]), **TOL)
    steps = [h for h in task.history if "loss" in h]
    assert max(h["train/clip_ratio/region"] for h in steps) > 0.1  # the clip acts on the reused rollouts
    assert all(h["train/clip_ratio/region"] < 0.9 for h in steps)  # and leaves tokens with a gradient
    # the step's divisor, logged under what it counts: completions (grpo, dr_grpo) or their tokens (dapo)
    unit = "train/completion_tokens" if objective == "dapo" else "train/completions"
    assert [h.get(unit) for h in steps] == reference["units"]
    params = next(h["params"] for h in task.history if "params" in h)
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, **TOL, msg=f"{objective} {layout}: {name}")
