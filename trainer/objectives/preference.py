"""Preference objectives: DPO, IPO, SimPO and ORPO on (prompt, chosen, rejected) pairs.

A batch holds pairs (trainer.data.preference): ``input_ids``, ``labels``, ``position_ids`` and
``document_ids`` are ``[P, 2, T]`` (index 0 of dim 1 = chosen, 1 = rejected; both rows start with
the same prompt tokens) and, for the objectives with a reference model, ``ref_logps`` is ``[P, 2]``
(the summed reference log-probs of the two responses: `PreferenceObjective.before_fit` scores
every pair with the initial policy once, before the first step, and the data module keeps the
table). Labels are pre-shifted and -100 everywhere but on response tokens, so a
sequence log-prob is a sum over response tokens only (case C24). The per-pair losses themselves are
pure functions in `trainer.objectives.pair_losses`; the classes here adapt them to the Task.

The Task divides ``loss_sum`` by the step's global ``num_tokens``; here that count is **pairs**
(``count_unit = "pairs"``): every pair weighs the same, whatever the number of its tokens, and grad
accumulation or data parallelism equal one big batch of pairs.

Each objective also sums, per pair, its implicit rewards of the chosen and rejected response, the
reward accuracy (chosen > rejected; a tie counts 1/2, so a policy equal to its reference scores
exactly 0.5) and the margin; the Task pops the sums after each step and each evaluation
(`pop_sums`), reduces them over data-parallel ranks and logs ``train/rewards/chosen``,
``train/rewards/rejected``, ``train/rewards/accuracy``, ``train/rewards/margin`` (``val/...``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Annotated, Any

import torch
from torch import nn
from typing_extensions import override

from strategies.core.model_contract import model_inputs
from strategies.core.ranges import NON_NEGATIVE, POSITIVE
from strategies.core.resolved import ResolvedRun
from trainer.data.encode import PAIR_KEYS
from trainer.objectives.pair_losses import IGNORE_INDEX, dpo_loss, ipo_loss, orpo_loss, sequence_logps, simpo_loss
from trainer.protocols import Objective

Losses = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per-pair losses, rewards chosen, rewards rejected
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")


def held_pairs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[P]`` bool: the rows of ``batch`` (``labels`` ``[P, 2, T]``) that hold a response token.

    Only the stand-in row an evaluation rank without held-out rows runs has none (its labels are
    all -100, `trainer.data.loader.shard_rows`); it must count as no pair, since pair objectives
    average over pairs, not tokens (a reference log-prob and a zero policy log-prob made it a pair
    with a loss, and the held-out loss changed with dp)."""
    return (batch["labels"] != IGNORE_INDEX).flatten(1).any(-1)


def reference_logps(task: Any, rows: dict[str, torch.Tensor], score: Any) -> torch.Tensor:
    """``[N, 2]`` summed log-probs of the ``[N, 2, T]`` pairs ``rows`` under ``task.model``, on CPU.

    Each dp rank scores its contiguous share in micro-batches of ``task.micro_batch_size`` pairs
    and one all-reduce over dp gives every rank the whole table. Every rank runs the same number
    of forwards (FSDP gathers parameters collectively): a short rank repeats its last pair and
    drops the repeat.

    Args:
        task: the Task (its model, device, micro-batch size, trainer's strategy and precision).
        rows: key -> ``[N, 2, T]`` tensor.
        score: ``(model, batch) -> (logps [P, 2], tokens [P, 2])``.
    """
    strategy = task.trainer.strategy
    dp = strategy.distributed_sampler_kwargs
    num = rows["input_ids"].shape[0]
    per_rank = -(-num // dp["num_replicas"])
    mine = range(dp["rank"] * per_rank, min(num, (dp["rank"] + 1) * per_rank))
    table = torch.zeros(num, 2, dtype=torch.float32, device=task.device)  # fp32 under bf16-true too
    step = max(1, task.micro_batch_size)
    whole = (
        strategy.whole_rows if strategy.dims.cp > 1 else contextlib.nullcontext
    )  # cp: every cp rank scores them whole
    for start in range(0, per_rank, step):
        idx = [mine[min(j, len(mine) - 1)] if len(mine) else 0 for j in range(start, min(per_rank, start + step))]
        batch = {k: v[idx].to(task.device) for k, v in rows.items()}
        with task.trainer.precision_plugin.forward_context(), strategy.loss_context(), whole():
            logps, _ = score(task.model, batch)
        valid = [j for j, i in enumerate(idx) if start + j < len(mine)]
        table[[idx[j] for j in valid]] = logps[valid].float()
    strategy.all_reduce_sum(table, "dp")
    return table.cpu()


class PreferenceObjective(Objective):
    """Base of the preference objectives: one forward of the chosen and rejected rows together.

    Subclasses set ``needs_reference`` and implement ``pair_losses``. The Task calls
    ``before_fit`` (the reference pre-pass, when ``needs_reference``), ``num_tokens`` (pairs),
    ``loss_sum`` and ``pop_sums``.
    """

    needs_reference = True
    count_unit = "pairs"
    step_count_name = "pairs"
    # Held-out reward accuracy (chance 0.5) and margin show whether the policy learns the preferences.
    headline_metrics = ("rewards/accuracy", "rewards/margin")
    row_kind = "pairs"  # "unpaired" for KTO (data.unpaired=true; trainer.objectives.kto)

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None  # [len(METRICS) + 1]: metric sums and pairs

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """`Objective.problems` for `trainer.config.validate`: pairs need preference data (the data
        module's row kind, ``run.row_kind``), and layouts that keep each row whole (no pp; cp only
        with hybrid placement, `_cp_problems`)."""
        problems = []
        given = run.row_kind if run is not None else None
        if given is not None and given not in ("pairs", "unpaired"):
            problems.append(
                f"objective {cls.__name__} trains on preference pairs; use data=preference (or preference_synthetic)"
            )
        if run is not None and run.dims.pp > 1:
            problems.append(f"objective {cls.__name__} does not support strategy.pp={run.dims.pp}; use strategy.pp=1")
        if run is not None and run.dims.cp > 1:
            problems += cls._cp_problems(run)
        if given == "unpaired" and cls.row_kind == "pairs":
            problems.append(
                f"objective {cls.__name__} trains on pairs; remove data.unpaired=true (unpaired rows: plait kto)"
            )
        if given == "pairs" and cls.row_kind == "unpaired":
            problems.append(
                f"objective {cls.__name__} trains on unpaired rows; set data.unpaired=true (plait kto does)"
            )
        if node.get("loss_chunk_tokens"):
            problems.append("objective.loss_chunk_tokens is not used by preference objectives; remove it")
        return problems

    @classmethod
    def _cp_problems(cls, run: ResolvedRun) -> list[str]:
        """Pairs under cp train whole, ``1/cp`` of a dp rank's pairs on each cp rank (hybrid
        placement, `strategies.context.placement`): a pair's log-probs sum over whole rows, so a pair is
        never split. That needs placement=hybrid, pairs per dp rank a multiple of cp and
        micro-batches of at least cp pairs (a whole micro-batch holds ``micro_batch_size // cp``)."""
        cp, dp, name, placement = run.dims.cp, run.dims.dp, cls.__name__, run.cp_placement
        if (
            cls.row_kind == "unpaired"
        ):  # KTO's KL estimate is a mean over a micro-batch's rows: not placed over cp ranks (not built)
            return [f"objective {name} does not support strategy.cp={cp}; use strategy.cp=1"]
        if placement != "hybrid":
            return [
                f"objective {name} does not support strategy.cp={cp} with placement={placement} (a pair's log-probs sum "
                f"over whole rows); use strategy.cp=1 or strategy.context_parallel.placement=hybrid (each pair then "
                f"trains whole on one cp rank)"
            ]
        problems = []
        if run.global_batch_size // dp % cp:
            problems.append(
                f"objective {name} under cp trains each pair whole on one cp rank: train.global_batch_size="
                f"{run.global_batch_size} gives {run.global_batch_size // dp} pairs per dp rank, not a multiple of cp={cp}; "
                f"use a multiple of dp x cp = {dp * cp}"
            )
        if run.micro_batch_size < cp:
            problems.append(
                f"objective {name} under cp trains micro-batches of micro_batch_size // cp whole pairs: "
                f"train.micro_batch_size={run.micro_batch_size} < cp={cp}; set train.micro_batch_size >= {cp}"
            )
        return problems

    @override
    @torch.no_grad()
    def before_fit(self, task: Any) -> None:
        """Reference log-probs of every train and validation pair, scored with the initial policy
        (which *is* the reference model before the first step), handed to the data module.

        Rather than a second, frozen copy of the model sharded like the policy, training then
        holds one model (FSDP and TP included) and the reference costs one forward per pair, once.
        Every rank calls it; a no-op for reference-free objectives and once the data module holds
        the tables (a restored run keeps its own).
        """
        data = task.trainer.datamodule
        if not self.needs_reference or data.reference_ready:
            return
        was_training = task.model.training
        task.model.eval()
        for split in ("train", "val"):
            data.set_reference(split, reference_logps(task, data.pairs(split), self.sequence_logps_of))
        task.model.train(was_training)

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pairs in ``batch`` that hold a response token (0-dim fp32): the unit every pair loss is
        averaged over. A row without any (the stand-in an evaluation rank without held-out rows
        runs, `trainer.data.loader.shard_rows`) is not a pair: it counts 0 and adds 0."""
        return held_pairs(batch).sum().float()

    def sequence_logps_of(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logps [P, 2], tokens [P, 2])``: summed response log-probs of the chosen and rejected
        rows under ``model`` (one forward of all 2P rows) and their response lengths."""
        pairs, _, length = batch["input_ids"].shape
        rows = {k: batch[k].reshape(2 * pairs, length) for k in PAIR_KEYS if k in batch}
        logits = model(rows["input_ids"], **model_inputs(model, rows))
        logps, tokens = sequence_logps(logits, rows["labels"])
        return logps.view(pairs, 2), tokens.view(pairs, 2)

    def pair_losses(self, logps: torch.Tensor, tokens: torch.Tensor, ref_logps: torch.Tensor | None) -> Losses:
        """``(losses, rewards_chosen, rewards_rejected)``, each ``[P]``, from ``[P, 2]`` inputs."""
        raise NotImplementedError

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed pair loss of ``batch`` (0-dim fp32); also adds the pairs' reward metrics to the sums.

        Raises:
            KeyError: a reference-based objective got a batch without ``ref_logps`` (``before_fit``
                did not run).
        """
        logps, tokens = self.sequence_logps_of(model, batch)
        ref = batch["ref_logps"].to(logps.dtype) if self.needs_reference else None
        losses, rewards_c, rewards_r = self.pair_losses(logps, tokens, ref)
        held = held_pairs(batch)
        self._accumulate(rewards_c.detach(), rewards_r.detach(), held)
        return torch.where(held, losses, 0.0).sum()

    def _accumulate(self, rewards_c: torch.Tensor, rewards_r: torch.Tensor, held: torch.Tensor) -> None:
        rewards_c, rewards_r = rewards_c.float(), rewards_r.float()  # sums in fp32 (bf16-true's are bf16)
        diff = rewards_c - rewards_r
        accuracy = (diff > 0).float() + 0.5 * (diff == 0).float()
        sums = torch.stack(
            [torch.where(held, value, 0.0).sum() for value in (rewards_c, rewards_r, accuracy, diff)]
            + [held.sum().to(diff.dtype)]
        )
        self._sums = sums if self._sums is None else self._sums + sums

    @override
    def pop_sums(self) -> tuple[list[str], torch.Tensor] | None:
        """``(METRICS, [2, len(METRICS)] tensor)``: per-pair metric sums since the last call and,
        in row 1, the number of pairs (this rank's share; the Task all-reduces and divides)."""
        sums, self._sums = self._sums, None
        if sums is None:
            sums = torch.zeros(len(METRICS) + 1, dtype=torch.float32)
        return list(METRICS), torch.stack([sums[:-1], sums[-1].expand(len(METRICS))])


class _WithBeta(PreferenceObjective):
    """A preference objective with a positive ``beta`` (its meaning is the subclass's)."""

    def __init__(self, beta: Annotated[float, POSITIVE] = 0.1) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"objective.beta={beta} must be positive")
        self.beta = beta


class DPO(_WithBeta):
    """DPO (sigmoid loss; `dpo_loss`). Args: beta: KL strength (0.1 in the paper)."""

    @override
    def pair_losses(self, logps: torch.Tensor, tokens: torch.Tensor, ref_logps: torch.Tensor | None) -> Losses:
        ratio = logps - ref_logps
        return dpo_loss(ratio[:, 0], ratio[:, 1], beta=self.beta)


class IPO(_WithBeta):
    """IPO (length-averaged log-ratios; `ipo_loss`). Args: beta: the target margin is 1/(2 beta)."""

    @override
    def pair_losses(self, logps: torch.Tensor, tokens: torch.Tensor, ref_logps: torch.Tensor | None) -> Losses:
        ratio = logps - ref_logps
        return ipo_loss(ratio[:, 0], ratio[:, 1], tokens[:, 0], tokens[:, 1], beta=self.beta)


class SimPO(PreferenceObjective):
    """SimPO (reference-free; `simpo_loss`). Args: beta: reward scale (2.0); gamma: target margin (1.0)."""

    needs_reference = False

    def __init__(self, beta: Annotated[float, POSITIVE] = 2.0, gamma: float = 1.0) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"objective.beta={beta} must be positive")
        self.beta, self.gamma = beta, gamma

    @override
    def pair_losses(self, logps: torch.Tensor, tokens: torch.Tensor, ref_logps: torch.Tensor | None) -> Losses:
        return simpo_loss(logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1], beta=self.beta, gamma=self.gamma)


class ORPO(PreferenceObjective):
    """ORPO (NLL + odds ratio, reference-free; `orpo_loss`). Args: lam: odds-ratio weight (0.1)."""

    needs_reference = False

    def __init__(self, lam: Annotated[float, NON_NEGATIVE] = 0.1) -> None:
        super().__init__()
        if lam < 0 or math.isnan(lam):
            raise ValueError(f"objective.lam={lam} must be >= 0")
        self.lam = lam

    @override
    def pair_losses(self, logps: torch.Tensor, tokens: torch.Tensor, ref_logps: torch.Tensor | None) -> Losses:
        return orpo_loss(logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1], lam=self.lam)
