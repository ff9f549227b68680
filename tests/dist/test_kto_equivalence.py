"""KTO under FSDP (2 gloo ranks) equals one process, and both equal a plain PyTorch loop whose
sequence log-probs and KTO loss are written here (TRL's formula: tests/unit/test_kto.py).

fp32, nano Llama, the synthetic ``copy`` pairs unpaired (``data.unpaired=true``: each pair gives
a desirable and an undesirable row, each row with a mismatched completion for the KL estimate),
global batch 8 rows, 3 steps of SGD with momentum 0.9 (lr 1.0, constant; no clipping); the
undesirable weight 0.2 makes the KL estimate positive after step 1 (so it is not clamped away). The KL
estimate is the mean over one micro-step's rows on every rank, so FSDP runs 4 rows per rank and
no accumulation (8 rows per micro-step, as one process). Compared: every step's loss and the
parameters after 3 steps, within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from trainer.model_node import instantiate_model

from harness import compose_config, fit, losses
from trainer.build import build_data
from trainer.data.sampler import GlobalBatchSampler

STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
COMMON = (
    "model=nano",
    "+model.vocab_size=288",
    "data=preference_synthetic",
    "data.seq_len=24",
    "data.max_prompt_len=12",
    "data.sources.copy.limit=24",
    "data.sources.copy.val_size=4",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "strategy.timeout_s=120",
    "logger=none",
    "~callbacks.plots",
    "~callbacks.checkpoint",
    "optim=sgd",
    "optim.lr=1.0",
    "scheduler=constant",
    "scheduler.warmup_steps=0",
    "train.max_grad_norm=0",
    f"trainer.max_steps={STEPS}",
    "+callbacks.params._target_=harness.ParamRecorder",
    "objective.beta=0.5",
    "objective.undesirable_weight=0.2",  # KL estimates > 0 at steps 2 and 3
)
LAYOUTS = {
    "one_process": ["train.micro_batch_size=8"],
    "fsdp2": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=4"],
}


def _cfg(overrides):
    return compose_config([*COMMON, *overrides], recipe="kto", tiny=False)


def _logps(model, rows):
    """``[P, 2]`` summed log p(label) of the row pairs, written out (log_softmax, gather, mask)."""
    pairs, _, length = rows["input_ids"].shape
    flat = {k: rows[k].reshape(2 * pairs, length) for k in ("input_ids", "labels", "position_ids", "document_ids")}
    logits = model(flat["input_ids"], position_ids_bt=flat["position_ids"], document_ids_bt=flat["document_ids"])
    logp = torch.log_softmax(logits.float(), -1)
    mask = flat["labels"] != -100
    picked = torch.gather(logp, -1, flat["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1).view(pairs, 2)


@pytest.fixture(scope="module")
def reference() -> dict:
    cfg = _cfg([])
    rows = build_data(cfg).prepare().train
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model)
    with torch.no_grad():
        ref = _logps(model, rows)
    beta, dw, uw = cfg.objective.beta, cfg.objective.desirable_weight, cfg.objective.undesirable_weight
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    sampler = GlobalBatchSampler(
        len(rows["input_ids"]), global_batch_size=8, dp_size=1, shuffle=True, seed=cfg.data.seed
    )
    out = {"loss": []}
    for _, index in zip(range(STEPS), sampler):
        batch = {k: v[index] for k, v in rows.items()}
        ratio = _logps(model, batch) - ref[index]
        kl = ratio[:, 1].mean().detach().clamp(min=0)
        good = batch["desirable"] > 0.5
        per_row = torch.cat(
            [
                dw * (1 - torch.sigmoid(beta * (ratio[good, 0] - kl))),
                uw * (1 - torch.sigmoid(beta * (kl - ratio[~good, 0]))),
            ]
        )
        loss = per_row.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        out["loss"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kto_layout_matches_plain_loop(layout, reference, tmp_path):
    _, task = fit(_cfg(LAYOUTS[layout]), tmp_path)
    got = losses(task.history)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference["loss"]), **TOL)
    assert reference["loss"][-1] < reference["loss"][0] - 1e-3  # it trains
    assert all(h["train/kl"] > 0.1 for h in task.history if "loss" in h and h["step"] > 1)  # the KL estimate is in play
    # the loss divisor, named for what it counts: the step's 8 completions (not "supervised_tokens")
    assert [h.get("train/completions") for h in task.history if "loss" in h] == [8.0] * STEPS
    params = [h["params"] for h in task.history if "params" in h][0]
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, **TOL, msg=f"{layout}: {name}")
