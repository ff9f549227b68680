"""DPO under FSDP (2 ranks, grad accumulation 2) and tensor parallelism (2 ranks, loss parallel)
equals one process, and one process equals a plain PyTorch loop.

fp32, nano Llama, the synthetic ``copy`` preference set (rows of 24 tokens), global batch 8
pairs, 3 steps of SGD with momentum 0.9 (lr 0.5, constant; no clipping). The plain loop: the same
initial weights, the reference log-probs computed once with them, the same pairs in the same
global-batch order, loss = mean over the 8 pairs of DPO's per-pair loss. Compared: the loss of
every step (within 1e-5) and the parameters after the 3 steps (within 1e-5); the reference
pre-pass of each layout gives the same ``[pairs, 2]`` table.
"""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from harness import compose_config, fit, losses
from trainer.build import build_data
from trainer.data.sampler import GlobalBatchSampler
from trainer.objectives.preference import DPO

STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
COMMON = (
    "model=nano", "+model.vocab_size=288", "data=preference_synthetic", "data.seq_len=24", "data.max_prompt_len=12",
    "data.sources.copy.limit=48", "data.sources.copy.val_size=8", "train.global_batch_size=8",
    "train.eval_every=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
    "strategy.timeout_s=120", "logger=none", "~callbacks.plots", "~callbacks.checkpoint",
    "optim=sgd", "optim.lr=0.5", "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=0",
    f"trainer.max_steps={STEPS}", "+callbacks.params._target_=harness.ParamRecorder",
)  # fmt: skip
LAYOUTS = {
    "one_process": ["train.micro_batch_size=8"],
    "fsdp2_ga2": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"],
    "tp2_lp": ["strategy=tp", "trainer.devices=2", "strategy.tensor_parallel.sequence_parallel=false"],
}


def _cfg(overrides):
    return compose_config([*COMMON, *overrides], recipe="dpo", tiny=False)


@pytest.fixture(scope="module")
def reference() -> dict:
    """A plain loop: reference log-probs from the initial weights, then SGD on the mean pair loss."""
    cfg = _cfg([])
    prepared = build_data(cfg).prepare()
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)  # vocab_size 288: a multiple of tp=2
    objective = DPO(beta=cfg.objective.beta)
    rows = prepared.train
    with torch.no_grad():
        ref_logps, _ = objective.sequence_logps_of(model, rows)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    sampler = GlobalBatchSampler(len(rows["input_ids"]), global_batch_size=8, dp_size=1, shuffle=True, seed=cfg.data.seed)
    out = {"loss": []}
    for _, index in zip(range(STEPS), sampler):
        batch = {k: v[index] for k, v in rows.items()}
        logps, tokens = objective.sequence_logps_of(model, batch)
        pair_losses, _, _ = objective.pair_losses(logps, tokens, ref_logps[index])
        loss = pair_losses.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        out["loss"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dpo_layout_matches_plain_loop(layout, reference, tmp_path):
    _, task = fit(_cfg(LAYOUTS[layout]), tmp_path)
    got = losses(task.history)
    assert got[0] == pytest.approx(0.6931472, abs=1e-6)  # the policy is its reference at step 1: -log sigmoid(0)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference["loss"]), **TOL)
    assert reference["loss"][-1] < reference["loss"][0] - 1e-3  # it trains (the comparison is not of constants)
    params = [h["params"] for h in task.history if "params" in h][0]
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, **TOL, msg=f"{layout}: {name}")
