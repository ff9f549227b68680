"""``model.tie_embeddings=true`` keeps the input embedding and the LM head one tensor in every
layout the matrix accepts, and trains like a one-process model the test ties itself (issue 30).

A multi-rank run builds the model on the meta device and materialises it with ``to_empty``, which
gives each plain (non-DTensor) parameter slot its own tensor: under the local-SGD presets (no FSDP
at dp_shard=1) the head became a second, separately initialised weight, 0.125 away from the
embedding after 2 steps, while one process, DDP and FSDP stayed tied. A layout-specific untie is
invisible to one-process tests, hence the sweep over `matrix.STRATEGIES` (pretrain, 3 steps,
gloo ranks): validate refuses each pipeline layout (the embedding and the head live on different
stages) naming ``model.tie_embeddings=false``; every other layout trains, and on every rank the
head ``is`` the embedding, their full tensors are bitwise equal, and every rank holds the same
embedding (the islands of local SGD synchronise every step here, `matrix.STRATEGIES`).

Reference, written here: plait's untied Llama (or MoE transformer) of the same seed with its head
pointed at its embedding by the test, trained by `harness.reference_run` (one forward of each
step's global batch, token-mean cross-entropy, SGD with momentum). Every step's loss and the final
embedding equal it within 1e-5 (the matrix's tolerance); under DES-LOC and Local Adam (Adam, whose
averaged moments are not Adam's on the averaged gradient) the first loss does, which the untied
head's own initialisation changed.

The default suite runs DiLoCo (the layout that lost the tie) for the Llama and the MoE model, FSDP 2
for the Llama, and every pipeline refusal; the whole sweep (35 more runs, about 5 minutes on 2 shared cores) is slow::

    python -m pytest tests/dist/test_tied_layouts.py -m slow -q
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch

import matrix
from harness import MOE_SMALL, compose_config, fit, losses, reference_run
from trainer.config import ConfigError, validate

STEPS = 3
TOL = {"rtol": matrix.TOL, "atol": matrix.TOL}
TIED = ("model.tie_embeddings=true", f"trainer.max_steps={STEPS}", "+callbacks.ties._target_=harness.TieRecorder")
# Router losses and bias updates off: the reference's loss is the token cross-entropy alone.
MOE = (*MOE_SMALL, "model.balance_coef=0", "model.z_loss_coef=0", "model.bias_update_rate=0")
MODELS = {"llama": (), "moe": MOE}
FAST = {("llama", "diloco2"), ("llama", "fsdp2"), ("moe", "diloco2")}


def _layouts() -> list:
    cases = []
    for model in MODELS:
        for layout in matrix.STRATEGIES:
            refused = "pp" in layout  # validate only: seconds
            slow = () if refused or (model, layout) in FAST else (pytest.mark.slow,)
            if model == "moe" and refused:
                continue  # the refusal is the layout's, checked with the Llama
            cases.append(pytest.param(model, layout, id=f"{model}-{layout}", marks=slow))
    return cases


def _overrides(model: str, layout: str) -> list[str]:
    return [*matrix.Combo("pretrain", layout, "base").overrides(), *MODELS[model], *TIED]


def tie(model: torch.nn.Module) -> None:
    """The test's own tie: the head's weight becomes the embedding's."""
    model.output.weight = model.tok_embeddings.weight


@cache
def reference(model: str) -> dict:
    """The one-process loop of the test's tied model (built untied by plait, tied by `tie`)."""
    one_process = matrix.Combo("pretrain", "ddp2", "base").reference_overrides()  # ddp2 shares no model/optim override
    cfg = compose_config([*one_process, *MODELS[model], f"trainer.max_steps={STEPS}", "model.tie_embeddings=false"], tiny=False)
    return reference_run(cfg, STEPS, edit=tie)


@pytest.mark.parametrize(("model", "layout"), _layouts())
def test_tied_embeddings_are_one_tensor_and_train_like_one_process(model, layout, tmp_path):
    cfg = compose_config(_overrides(model, layout), tiny=False)
    try:
        run = validate(cfg)
    except ConfigError as err:
        assert "pp" in layout, f"{layout} refused: {err.problems}"
        assert any("use model.tie_embeddings=false or strategy.pp=1" in p for p in err.problems), err.problems
        return
    assert "pp" not in layout, f"{layout}: tied embeddings across pipeline stages were accepted"
    assert run.world_size > 1 and not any(o.startswith("model.") for o in matrix.STRATEGIES[layout])  # the reference's model
    _, task = fit(cfg, tmp_path)
    (ties,) = [h["ties"] for h in task.history if "ties" in h]
    assert len(ties) == run.world_size
    for rank, seen in enumerate(ties):
        assert seen["one_tensor"] and seen["equal"], f"rank {rank}: the head is another tensor (equal: {seen['equal']})"
        assert torch.equal(seen["embedding"], ties[0]["embedding"]), f"rank {rank} holds another embedding"
    want, got = reference(model), losses(task.history)
    assert len(got) == STEPS and all(map(math.isfinite, got))
    if any(o.startswith("optim=") for o in matrix.STRATEGIES[layout]):  # Adam's islands: the first step
        torch.testing.assert_close(got[0], want["loss"][0], **TOL, msg="loss at step 1")
        return
    torch.testing.assert_close(got, want["loss"], **TOL, msg="losses")
    torch.testing.assert_close(ties[0]["embedding"], want["params"]["tok_embeddings.weight"], **TOL, msg="embedding")
