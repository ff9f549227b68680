"""One validation contract (`trainer.protocols.Component`): `trainer.config.validate` asks the class
of each component a config selects (objective, data module, the data module's evaluators) for its
own ``problems(run, node)``, and the data module's declared row kind (`DataModule.row_kind_of`)
meets the objective's (`Objective.row_kind`). `trainer.semantics` keeps only rules between groups:
each rule that belongs to one component comes out of that component, with the same message.

`Toy` is an objective added from user code: a class here and a Hydra node, no edit of plait.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import compose_config, fit, losses
from torch import nn

from strategies.core.resolved import ResolvedRun
from trainer.compose import compose
from trainer.config import ConfigError, validate
from trainer.protocols import Objective

ASKED: list[tuple[str, Any]] = []  # (class name, the node it was given) of every `problems` call below


class Toy(Objective):
    """A user's objective: ``weight`` x the summed next-token cross-entropy (`CausalLM`'s, scaled).

    Args:
        weight: the loss scale; `problems` refuses one that is not positive.
    """

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        ASKED.append((cls.__name__, node))
        problems = super().problems(run, node)  # the declared row kind against the data's
        if node.get("weight", 1.0) <= 0:
            problems.append(f"objective.weight={node.weight} must be positive; use objective.weight=1")
        return problems

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"] != -100).sum().float()

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["input_ids"], position_ids_bt=batch["position_ids"], document_ids_bt=batch["document_ids"])
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100, reduction="sum"
        )
        return self.weight * ce


class PairsToy(Toy):
    """A user's objective that declares it trains on preference pairs."""

    row_kind = "pairs"


TOY = ["~objective", f"+objective._target_={__name__}.Toy"]


def _problems(recipe: str, *overrides: str, tiny: bool = False) -> list[str]:
    """What `trainer.config.validate` refuses in ``plait <recipe> <overrides>`` ([] when it is valid)."""
    try:
        validate(compose_config(list(overrides), recipe=recipe, tiny=tiny))
    except ConfigError as err:
        return err.problems
    return []


def test_a_user_objective_validates_and_trains_end_to_end(tmp_path: Path) -> None:
    """Mutation: `trainer.config.component_problems` skipping the objective group fails the refusal."""
    ASKED.clear()
    cfg = compose_config([*TOY, "+objective.weight=0.5", "trainer.max_steps=1"])
    validate(cfg)
    assert [name for name, _ in ASKED] == ["Toy"] and ASKED[0][1].weight == 0.5  # its own node
    with_toy = losses(fit(cfg, tmp_path / "toy")[1].history)
    reference = losses(fit(compose_config(["trainer.max_steps=1"]), tmp_path / "ref")[1].history)
    assert len(with_toy) == 1 and with_toy[0] == torch.tensor(0.5 * reference[0]).item()  # Toy's loss drove the step

    problems = _problems("pretrain", *TOY, "+objective.weight=0", tiny=True)
    assert problems == ["objective.weight=0 must be positive; use objective.weight=1"], problems


def test_a_declared_row_kind_is_checked_against_the_data() -> None:
    """The protocol's default `Objective.problems`: a pair objective on token rows, and plait's
    causal LM on pairs (it failed at the first step: ``position_ids_bt must have shape [B, T]``).
    Mutation: `Objective.problems` returning [] fails it."""
    pairs_toy = ["~objective", f"+objective._target_={__name__}.PairsToy"]
    assert _problems("pretrain", *pairs_toy, tiny=True) == [
        "objective PairsToy trains on preference pairs, but the data module gives token rows; use a data group of "
        "preference pairs (`plait <recipe> --help` lists each group's choices)"
    ]
    assert _problems("dpo", *pairs_toy) == []
    causal = _problems("pretrain", "data=preference_synthetic")
    assert any(
        p.startswith("objective CausalLM trains on token rows, but the data module gives preference pairs; use ")
        for p in causal
    ), causal


def test_a_data_module_declares_its_evaluators_and_each_is_asked() -> None:
    """`SFTDataModule.evaluator_types` declares `ExactMatch` only for exact-match sources, and
    validate asks it with the data node. Mutation: `evaluator_types` returning [] fails it."""
    sp = ["data=synthetic", "strategy=tp", "trainer.devices=2"]  # every synthetic source: metric=exact_match
    assert [p for p in _problems("sft", *sp) if "decodes greedily" in p] == [
        "data.sources.reversal.metric=exact_match decodes greedily with whole sequences on every rank, which "
        "strategy.tensor_parallel.sequence_parallel=true does not give; use data.sources.reversal.metric=loss, "
        "data.sources.sorting.metric=loss, data.sources.addition.metric=loss "
        "(or strategy.tensor_parallel.sequence_parallel=false)"
    ]
    assert not any(
        "decodes greedily" in p for p in _problems("sft", *sp, "strategy.tensor_parallel.sequence_parallel=false")
    )
    pp = [p for p in _problems("sft", "data=synthetic", "strategy=pp", "trainer.devices=2") if "decodes greedily" in p]
    assert len(pp) == 1 and "strategy.pp=2 does not give" in pp[0] and "(or strategy.pp=1)" in pp[0], pp
    metrics = [f"data.sources.{name}.metric=loss" for name in compose("sft", ["data=synthetic"]).data.sources]
    assert not any("decodes greedily" in p for p in _problems("sft", *sp, *metrics))  # no exact-match source: not asked


def test_the_moved_rules_come_out_of_validate_with_their_messages() -> None:
    """Each rule `trainer.semantics` held by a technique's name now comes from its component;
    ``plait <recipe> ...`` still refuses with the same message (mutation: drop the rule from the
    component and its line is missing)."""
    tiny = ["model=nano", "data.seq_len=64"]
    chunked = _problems("pretrain", *tiny, "strategy=tp", "trainer.devices=2", "objective.loss_chunk_tokens=64")
    assert any(p.startswith("objective.loss_chunk_tokens=64 needs tp=1") for p in chunked), chunked  # CausalLM.problems
    sat = _problems("pretrain", *tiny, "+strategy/sat=default", "strategy.compile.enabled=true")
    assert "strategy.sat with strategy.compile.enabled=true is not supported; set one of them off" in sat, (
        sat
    )  # SAT.problems
    lora = _problems("pretrain", *tiny, "+strategy/lora=default")
    assert any(p.startswith("strategy.lora trains adapters on a frozen base") for p in lora), lora  # LoRA.problems
    dpo = _problems("dpo", "data=text")  # PreferenceObjective.problems, on the data's declared row kind
    assert "objective DPO trains on preference pairs; use data=preference (or preference_synthetic)" in dpo, dpo
    assert not any(p.startswith("objective DPO trains on preference pairs, but") for p in dpo), (
        dpo
    )  # its own message only


def test_a_callback_with_problems_is_asked() -> None:
    """`LMEval.problems`: validate asks a callback class that has ``problems`` (the lm-eval callback
    refuses layouts without whole sequences per rank, only when it is on). Mutation: validate not
    asking callbacks fails it."""
    on = "callbacks.lm_eval.every_n_steps=10"
    pp = [p for p in _problems("pretrain", "strategy=pp", "trainer.devices=2", on) if "callbacks.lm_eval" in p]
    assert pp == [
        "callbacks.lm_eval scores whole sequences on every rank, which strategy.pp=2 does not give; evaluate after "
        "the run with plait eval ckpt=<run> (or callbacks.lm_eval.every_n_steps=0)"
    ]
    assert not any("callbacks.lm_eval" in p for p in _problems("pretrain", "strategy=pp", "trainer.devices=2"))
    assert _problems("pretrain", on, "callbacks.lm_eval.tasks=[]") == [
        "callbacks.lm_eval.tasks is empty; name lm-eval tasks (or callbacks.lm_eval.every_n_steps=0)"
    ]
    unknown = _problems("pretrain", on, "callbacks.lm_eval.tasks=[no_such_task]")
    assert len(unknown) == 1 and unknown[0].startswith(
        "callbacks.lm_eval.tasks: unknown lm-eval task(s) no_such_task; plait's and the include paths' tasks:"
    ), unknown


@pytest.mark.parametrize(
    ("recipe", "override", "refusal"),
    [
        ("dpo", "objective.beta=0", "objective.beta=0 must be > 0"),
        ("ipo", "objective.beta=-1", "objective.beta=-1 must be > 0"),
        ("simpo", "objective.beta=0", "objective.beta=0 must be > 0"),
        ("kto", "objective.undesirable_weight=0", "objective.undesirable_weight=0 must be > 0"),
        ("orpo", "objective.lam=-0.5", "objective.lam=-0.5 must be >= 0"),
        ("pretrain", "objective.loss_chunk_tokens=-3", "objective.loss_chunk_tokens=-3 must be >= 0"),
    ],
)
def test_an_objective_setting_out_of_range_is_refused_by_validate(recipe: str, override: str, refusal: str) -> None:
    """`plait dpo objective.beta=0` trained a tokenizer and prepared the data, then failed in Hydra's
    instantiation (a new user's walkthrough): the ranges are declared, so validate refuses it first."""
    assert refusal in _problems(recipe, override)


def test_sequence_parallel_needs_rows_that_tp_divides() -> None:
    """Sequence parallelism shards a row's tokens over tp; an odd data.seq_len crashed at step 0 with a gloo
    size mismatch. Mutation: `TensorParallel.problems` without the seq_len check accepts it."""
    tp = ("model=nano", "strategy=tp", "trainer.devices=2")
    (problem,) = _problems("pretrain", *tp, "data.seq_len=63")
    assert "data.seq_len=63" in problem and "strategy.tp=2" in problem and "multiple of 2" in problem
    assert "sequence_parallel=false" in problem
    assert _problems("pretrain", *tp, "data.seq_len=63", "strategy.tensor_parallel.sequence_parallel=false") == []
    assert _problems("pretrain", *tp, "data.seq_len=64") == []
