"""DPO, IPO, SimPO and ORPO trained through plait's Task equal a plain loop whose losses are written here.

fp32, nano Llama, the synthetic ``copy`` preference set (rows of 24 tokens), global batch 8 pairs,
3 steps of SGD with momentum 0.9 (constant lr: 0.5 for DPO, `LR`; no clipping). The plain loop (one process):
the same initial weights; the response log-probs summed here from the model's logits
(log-softmax at the labels, -100 = prompt and padding); for DPO and IPO the reference log-probs of
every pair computed once with the initial weights; the same pairs in the same global-batch order;
loss = mean over the 8 pairs of the paper's per-pair loss, written below (not plait's):

- DPO (Rafailov et al. 2023, eq. 7): ``-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))``;
- IPO (Azar et al. 2023, eq. 17): ``(h - 1/(2 beta))^2`` with h the difference of the chosen and
  rejected log-ratios, each averaged over its response tokens (plait's documented IPO, case C25);
- SimPO (Meng et al. 2024, eq. 6): ``-log sigmoid(beta/|y_c| log pi_c - beta/|y_r| log pi_r - gamma)``;
- ORPO (Hong et al. 2024, eqs. 6-7): ``-a_c + lam (-log sigmoid(log odds_c - log odds_r))`` with
  ``a = log pi(y|x) / |y|`` and ``log odds = a - log(1 - e^a)``.

Layouts: DPO on one process, FSDP 2 ranks with grad accumulation 2, TP 2 with loss parallel and
FSDP 2 x CP 2 with hybrid placement (every pair whole on one cp rank, its reference log-probs and
its evaluation too; asserted from ``perf/cp_whole_rows``; the validation loss after the last step
is compared too);
IPO and ORPO on FSDP 2 (grad accumulation 2), ORPO on CP 2 with hybrid placement (its loss holds
the chosen log-probs, so a wrong attention in evaluation shows; DPO's margins hide it below
1e-5), SimPO on DDP 2 (real gloo processes). Compared: the
loss of every step (within 1e-5) and the parameters after the 3 steps (within 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from trainer.model_node import instantiate_model

from harness import compose_config, fit, losses
from trainer.build import build_data
from trainer.data.sampler import GlobalBatchSampler

STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
IGNORE = -100
COMMON = (
    "model=nano", "+model.vocab_size=288", "data=preference_synthetic", "data.seq_len=24", "data.max_prompt_len=12",
    "data.sources.copy.limit=48", "data.sources.copy.val_size=8", "train.global_batch_size=8",
    "train.eval_every=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
    "strategy.timeout_s=120", "logger=none", "~callbacks.plots", "~callbacks.checkpoint",
    "optim=sgd", "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=0",
    f"trainer.max_steps={STEPS}", "+callbacks.params._target_=harness.ParamRecorder",
)
ONE = ["train.micro_batch_size=8"]
FSDP2_GA2 = ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"]
DDP2 = ["strategy=ddp", "trainer.devices=2", "train.micro_batch_size=4"]
TP2_LP = ["strategy=tp", "trainer.devices=2", "strategy.tensor_parallel.sequence_parallel=false"]
# cp hybrid placement: each pair whole on one cp rank (2 of a dp rank's 4 per cp rank), FSDP over all 4
FSDP2_CP2_HYBRID = ["strategy=nd", "strategy.dp_shard=2", "strategy.cp=2", "trainer.devices=4", "train.micro_batch_size=2",
                    "strategy.context_parallel.placement=hybrid", f"train.eval_every={STEPS}"]
CP2_HYBRID = ["strategy=cp", "trainer.devices=2", "train.micro_batch_size=2", "strategy.context_parallel.placement=hybrid",
              f"train.eval_every={STEPS}"]
CASES = {
    "dpo-one_process": ("dpo", ONE),
    "dpo-fsdp2_ga2": ("dpo", FSDP2_GA2),
    "dpo-tp2_lp": ("dpo", TP2_LP),
    "dpo-fsdp2_x_cp2_hybrid": ("dpo", FSDP2_CP2_HYBRID),
    "ipo-fsdp2_ga2": ("ipo", FSDP2_GA2),
    "simpo-ddp2": ("simpo", DDP2),
    "orpo-fsdp2_ga2": ("orpo", FSDP2_GA2),
    "orpo-cp2_hybrid": ("orpo", CP2_HYBRID),  # its loss holds the chosen log-probs themselves: an eval that attends wrong shows
}


# Per objective, a learning rate at which 3 steps lower the loss (IPO's squared loss has large gradients).
LR = {"dpo": 0.5, "ipo": 0.01, "simpo": 0.2, "orpo": 0.2}


def _cfg(recipe: str, overrides):  # noqa: ANN001, ANN202
    return compose_config([*COMMON, f"optim.lr={LR[recipe]}", *overrides], recipe=recipe, tiny=False)


def response_logps(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed log-probs [P, 2], response lengths [P, 2])`` of the chosen and rejected rows."""
    P, _, T = rows["input_ids"].shape
    flat = {k: rows[k].reshape(2 * P, T) for k in ("input_ids", "labels", "position_ids", "document_ids")}
    logits = model(flat["input_ids"], position_ids_bt=flat["position_ids"], document_ids_bt=flat["document_ids"])
    targets = flat["labels"] != IGNORE
    token_logps = logits.float().log_softmax(-1).gather(-1, flat["labels"].clamp(min=0)[..., None])[..., 0]
    return (token_logps * targets).sum(-1).view(P, 2), targets.sum(-1).float().view(P, 2)


def dpo(logps, tokens, ref, o):  # noqa: ANN001, ANN201
    margin = (logps[:, 0] - ref[:, 0]) - (logps[:, 1] - ref[:, 1])
    return -F.logsigmoid(o.beta * margin)


def ipo(logps, tokens, ref, o):  # noqa: ANN001, ANN201
    h = (logps[:, 0] - ref[:, 0]) / tokens[:, 0] - (logps[:, 1] - ref[:, 1]) / tokens[:, 1]
    return (h - 1 / (2 * o.beta)) ** 2


def simpo(logps, tokens, ref, o):  # noqa: ANN001, ANN201
    return -F.logsigmoid(o.beta * logps[:, 0] / tokens[:, 0] - o.beta * logps[:, 1] / tokens[:, 1] - o.gamma)


def orpo(logps, tokens, ref, o):  # noqa: ANN001, ANN201
    a = logps / tokens
    log_odds = a - torch.log1p(-torch.exp(a))
    return -a[:, 0] + o.lam * -F.logsigmoid(log_odds[:, 0] - log_odds[:, 1])


PAIR_LOSS = {"dpo": dpo, "ipo": ipo, "simpo": simpo, "orpo": orpo}


def plain_loop(recipe: str) -> dict:
    """SGD on the mean of the test's pair loss, one process; reference log-probs from the initial weights."""
    cfg = _cfg(recipe, [])
    prepared = build_data(cfg).prepare()
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model)  # vocab_size 288: a multiple of tp=2
    initial = copy.deepcopy(model)
    rows = prepared.train
    with torch.no_grad():
        ref_logps, tokens = response_logps(model, rows)
    assert (tokens > 0).all()  # every response keeps tokens: no guard is needed in the test's losses
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    sampler = GlobalBatchSampler(len(rows["input_ids"]), global_batch_size=8, dp_size=1, shuffle=True, seed=cfg.data.seed)
    out = {"loss": []}
    for _, index in zip(range(STEPS), sampler):
        batch = {k: v[index] for k, v in rows.items()}
        logps, tokens = response_logps(model, batch)
        loss = PAIR_LOSS[recipe](logps, tokens, ref_logps[index], cfg.objective).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        out["loss"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():  # the validation loss after the last step: mean pair loss of the held-out pairs
        val_ref, _ = response_logps(initial, prepared.val)
        logps, tokens = response_logps(model, prepared.val)
        out["val_loss"] = PAIR_LOSS[recipe](logps, tokens, val_ref, cfg.objective).mean().item()
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    cache: dict[str, dict] = {}
    return cache


@pytest.mark.parametrize("case", list(CASES))
def test_preference_layout_matches_plain_loop(case, references, tmp_path):
    recipe, layout = CASES[case]
    if recipe not in references:
        references[recipe] = plain_loop(recipe)
    reference = references[recipe]
    _, task = fit(_cfg(recipe, layout), tmp_path)
    got = losses(task.history)
    hybrid = "strategy.context_parallel.placement=hybrid" in layout
    if hybrid:  # every pair of a cp group trains whole
        pairs = 8 // (2 if "strategy.dp_shard=2" in layout else 1)
        assert [h["perf/cp_whole_rows"] for h in task.history if "perf/cp_whole_rows" in h] == [pairs] * STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference["loss"]), **TOL)
    if recipe == "dpo":
        assert got[0] == pytest.approx(0.6931472, abs=1e-6)  # the policy is its reference at step 1: -log sigmoid(0)
    assert reference["loss"][-1] < reference["loss"][0] - 1e-3  # it trains (the comparison is not of constants)
    params = [h["params"] for h in task.history if "params" in h][0]
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, **TOL, msg=f"{case}: {name}")
    if hybrid:
        vals = {h["step"]: h["val_loss"] for h in task.history if "val_loss" in h}  # every cp rank evaluates pairs whole
        assert vals[STEPS] == pytest.approx(reference["val_loss"], rel=1e-5, abs=1e-5), vals
