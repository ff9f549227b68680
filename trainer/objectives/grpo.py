"""GRPO and its variants: online RL from the policy's own samples with verifiable rewards.

Each rollout: the G completions of every prompt of this rank's share of the step (sampled by the
generation engine, `trainer.rl.engine`), scored by the data's reward functions
(`trainer.rl.rewards`), advantages normalised within each group of G (`trainer.rl.advantages`),
then ``num_iterations`` optimizer steps on those rows with the clipped policy-ratio loss
(`trainer.rl.policy_loss`) against the log-probs of the policy that sampled them.

The variants users compare are presets of the same objective (conf/objective/):

- ``grpo`` (Shao et al. 2024, DeepSeekMath): group mean and std, per-sequence mean loss;
- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"): no std scaling, a
  constant normaliser (``max_new_tokens`` per sequence);
- ``dapo`` (Yu et al. 2025): asymmetric clip (``epsilon_high``), per-token loss over the step's
  completion tokens;
- ``gspo`` (Zheng et al. 2025): one importance ratio per sequence (the mean token log-ratio);
- ``rloo`` (Ahmadian et al. 2024): leave-one-out baseline, no std scaling, the whole completion
  one action (one ratio per row from its summed token log-ratios, as TRL's ``RLOOTrainer``).

The loss aggregation is named as TRL names it (``loss_type``) and expressed as a sum over this
rank's rows and a count of units the Task sums over every micro-batch and rank before dividing:
rows (sequences) for ``grpo`` and ``dr_grpo``, completion tokens for ``dapo``. So gradient
accumulation and data parallelism equal one process on the same rollouts.

With ``beta > 0`` the loss adds ``beta`` x the k3 estimate of KL(policy || reference); the
reference is the frozen base with the LoRA adapters off (`strategies.transforms.lora.adapters_off`),
so no second model is kept (``beta > 0`` needs ``strategy.lora``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

import lightning as L
import torch
from torch import nn

from strategies.core.model_contract import model_inputs
from strategies.core.resolved import ResolvedRun
from strategies.transforms.lora import adapters_off
from trainer.catalog import say
from trainer.objectives.pretrain import token_loss_sum
from trainer.protocols import Batch, Objective, RowKind
from trainer.rl.advantages import group_advantages
from trainer.rl.engine import GenerationEngine, InProcessEngine, SamplingParams
from trainer.rl.evaluate import completion_text, fields_of
from trainer.rl.policy_loss import AGGREGATIONS, IMPORTANCE_LEVELS, count_units, policy_loss
from trainer.rl.rewards import score, total
from trainer.rl.rollout import completion_seed, cut_at_stop, rollout_rows, token_logps, token_logps_and_entropy

IGNORE_INDEX = -100
FLAT_ROLLOUTS = 10  # rollouts in a row without any learning signal before the run says so


class GRPO(Objective):
    """The GRPO family (see module docstring).

    Args:
        num_generations: G, completions per prompt (>= 2: the group is the baseline).
        max_new_tokens: tokens per completion at most (its EOS included).
        temperature, top_p, top_k: sampling of the rollouts (`trainer.rl.engine.SamplingParams`); the
            loss, the sampling policy's and the reference's log-probs and the entropy are those of
            ``softmax(logits / temperature)``, the distribution sampled (as TRL does; top_p and top_k
            are not folded in).
        stop: strings that end a completion (the token that completes one is its last).
        epsilon: clip range below (and above, unless ``epsilon_high``) the ratio 1.
        epsilon_high: DAPO's upper clip (None: ``epsilon``).
        beta: weight of the KL term to the reference (0: none, no reference forward).
        loss_type: ``grpo``, ``dr_grpo`` or ``dapo`` (the aggregation; module docstring).
        importance: ``token`` (GRPO), ``sequence`` (GSPO: mean token log-ratio) or ``sequence_sum``
            (RLOO: summed token log-ratio) importance ratios.
        scale_rewards: ``group`` (divide by the group's std) or ``none`` (Dr. GRPO, RLOO).
        baseline: ``mean`` (the group mean) or ``leave_one_out`` (RLOO).
        num_iterations: optimizer steps per rollout (mu; > 1 computes the sampling policy's
            log-probs once after sampling, for the ratio).
        engine: the generation engine (None: `InProcessEngine`).
        seed: seeds the completions (`trainer.rl.rollout.completion_seed`).
    """

    row_kind: RowKind = "prompts"
    count_unit = "tokens"  # of the evaluation rows: val/loss is the held-out answers' NLL per token

    @property
    def step_count_name(self) -> str:
        """The training step's divisor (`count_units`): completions for grpo and dr_grpo, their tokens for dapo."""
        return "completion_tokens" if self.loss_type == "dapo" else "completions"

    def __init__(
        self,
        *,
        num_generations: int = 8,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: Sequence[str] = (),
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo",
        importance: Literal["token", "sequence", "sequence_sum"] = "token",
        scale_rewards: Literal["group", "none"] = "group",
        baseline: Literal["mean", "leave_one_out"] = "mean",
        num_iterations: int = 1,
        engine: GenerationEngine | None = None,
        seed: int = 0,
    ) -> None:
        problems = self.node_problems(locals())
        if problems:
            raise ValueError("; ".join(problems))
        self.num_generations, self.stop = num_generations, tuple(stop)
        self.params = SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        self.epsilon, self.epsilon_high, self.beta = epsilon, epsilon_high, beta
        self.loss_type, self.importance = loss_type, importance
        self.scale_rewards, self.baseline = scale_rewards, baseline
        self.num_iterations, self.seed = num_iterations, seed
        self.engine: GenerationEngine = engine if engine is not None else InProcessEngine()
        self._rollout: Batch | None = None
        self._rollout_sums: dict[str, tuple[float, float]] = {}
        self._sums: dict[str, list[float]] = {}
        self._reward_names: list[str] = []
        self._warned_resume = False
        self._flat_rollouts = 0  # rollouts in a row in which no group of this rank had a learning signal
        self._rollouts = 0  # rollouts of this process

    @staticmethod
    def node_problems(node: Any) -> list[str]:
        """The settings' own problems (each naming the fix)."""
        problems = []
        if int(node.get("num_generations", 8)) < 2:
            problems.append("objective.num_generations must be >= 2 (the group is the baseline); e.g. 8")
        if node.get("loss_type", "grpo") not in AGGREGATIONS:
            problems.append(f"objective.loss_type={node.get('loss_type')!r}: use one of {AGGREGATIONS}")
        if node.get("importance", "token") not in IMPORTANCE_LEVELS:
            problems.append(f"objective.importance={node.get('importance')!r}: use one of {IMPORTANCE_LEVELS}")
        if node.get("scale_rewards", "group") not in ("group", "none"):
            problems.append(f"objective.scale_rewards={node.get('scale_rewards')!r}: use group or none")
        if node.get("baseline", "mean") not in ("mean", "leave_one_out"):
            problems.append(f"objective.baseline={node.get('baseline')!r}: use mean or leave_one_out")
        if int(node.get("num_iterations", 1)) < 1:
            problems.append("objective.num_iterations must be >= 1")
        if int(node.get("max_new_tokens", 16)) < 1:
            problems.append("objective.max_new_tokens must be >= 1")
        if float(node.get("beta", 0.0)) < 0 or float(node.get("epsilon", 0.2)) < 0:
            problems.append("objective.beta and objective.epsilon must be >= 0")
        return problems

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """The settings' problems, data that is not prompts, and the layouts a rollout cannot run
        under: pp, cp and tp split the sequence or the model over ranks that the sampler needs
        whole; local SGD's islands are not built for it; ``beta > 0`` without LoRA has no reference."""
        problems = super().problems(run, node) + cls.node_problems(node)
        if run is None:
            return problems
        split = [f"strategy.{a}={getattr(run.dims, a)}" for a in ("pp", "cp", "tp") if getattr(run.dims, a) > 1]
        if split:
            problems.append(
                f"objective GRPO samples whole sequences with the policy on every rank, which {' and '.join(split)} "
                "does not give; use strategy=ddp or strategy=fsdp (with +strategy/lora=default for adapters)"
            )
        if run.islands:
            problems.append(
                "objective GRPO under local SGD (islands that synchronise now and then) is not built; use "
                "strategy=ddp or strategy=fsdp"
            )
        if float(node.get("beta", 0.0)) > 0 and not run.adapters:
            problems.append(
                f"objective.beta={node.get('beta')} needs a reference policy: plait uses the frozen base with the LoRA "
                "adapters off (no second model); add +strategy/lora=default, or set objective.beta=0 (no KL term)"
            )
        return problems

    # ------------------------------------------------------------------------------ the rollout phase
    def step_rows(self, task: L.LightningModule, batch: Batch) -> Batch:
        """The rollout rows of this step: sampled from the policy at the first of a prompt batch's
        ``num_iterations`` steps, the same rows at the others."""
        iteration = int(batch["iteration"][0])
        if iteration == 0 or self._rollout is None:
            if iteration and not self._warned_resume and task.trainer.is_global_zero:
                say(
                    f"warning: resumed at step {task.global_step} in the middle of a rollout's "
                    f"objective.num_iterations={self.num_iterations} steps; sampled the rest of it again from the "
                    "restored policy (checkpoint every objective.num_iterations steps to resume exactly)"
                )
                self._warned_resume = True
            self._rollout = self._roll_out(task, batch)
        else:
            self._add_rollout_sums()  # the same rows: the same rewards, logged at this step too
        return self._rollout

    def _all_done(self, task: L.LightningModule) -> Callable[[bool], bool] | None:
        strategy = task.trainer.strategy
        if strategy.dims.dp == 1:
            return None

        def all_done(local: bool) -> bool:
            pending = torch.tensor([0.0 if local else 1.0], device=task.device)
            return float(strategy.all_reduce_sum(pending, "dp_cp")) == 0.0

        return all_done

    @torch.no_grad()
    def _roll_out(self, task: L.LightningModule, batch: Batch) -> Batch:
        datamodule, model, G = task.trainer.datamodule, task.model, self.num_generations
        tokenizer = datamodule.tokenizer
        indices = batch["prompt_index"].tolist()
        items = datamodule.prompt_items(indices)
        prompts = [item.ids for item in items for _ in range(G)]
        stop_ids = datamodule.stop_ids()
        rollout = task.global_step // self.num_iterations
        seeds = [completion_seed(self.seed, rollout, i, g) for i in indices for g in range(G)]
        was_training = model.training
        model.eval()
        self.engine.sync_weights(model)  # the weights of every optimizer step so far (not in rollout_s)
        start = time.perf_counter()
        with task.trainer.precision_plugin.forward_context():
            completions = self.engine.generate(
                model,
                prompts,
                params=replace(self.params, stop_token_ids=stop_ids),
                eos_id=tokenizer.eos_id,
                seeds=seeds,
                all_done=self._all_done(task),
            )
        rollout_s = time.perf_counter() - start
        model.train(was_training)
        stop = (*self.stop, *datamodule.stop_texts())
        completions = [cut_at_stop(c, tokenizer, stop) for c in completions]
        texts = [completion_text(tokenizer, c, stop_ids, stop) for c in completions]
        values = score(datamodule.rewards, [item.text for item in items for _ in range(G)], texts, fields_of(items, G))
        rewards = torch.tensor(total(datamodule.rewards, values), dtype=torch.float32)
        advantages = group_advantages(rewards, G, scale=self.scale_rewards, baseline=self.baseline)
        rows = rollout_rows(prompts, completions, width=datamodule.seq_len, pad_id=tokenizer.pad_id)
        out = {**{k: v.to(task.device) for k, v in rows.items()}, "advantages": advantages.to(task.device)}
        if self.num_iterations > 1:
            out["old_logps"] = self._logps(task, out)
        if self.beta > 0:
            with adapters_off(model):
                out["ref_logps"] = self._logps(task, out)
        self._record_rollout(datamodule.rewards, values, rewards, completions, rollout_s)
        self._warn_if_flat(task, rewards)
        return out

    def _warn_if_flat(self, task: L.LightningModule, rewards: torch.Tensor) -> None:
        """Says once (rank 0) when FLAT_ROLLOUTS rollouts in a row gave every group equal rewards, or a
        shorter run's every rollout did by its last step: their advantages are all 0, so the run
        trains nothing (a fresh model that never hits the answer)."""
        groups = rewards.view(-1, self.num_generations)
        flat = bool((groups.max(1).values == groups.min(1).values).all())
        self._flat_rollouts = self._flat_rollouts + 1 if flat else 0
        self._rollouts += 1
        trainer = task.trainer
        # This rollout feeds steps global_step + 1 .. + num_iterations: the run's last among them?
        last_step = 0 < trainer.max_steps <= trainer.global_step + self.num_iterations
        whole_short_run = last_step and self._flat_rollouts == self._rollouts < FLAT_ROLLOUTS
        if (self._flat_rollouts == FLAT_ROLLOUTS or whole_short_run) and trainer.is_global_zero:
            n = self._flat_rollouts
            say(
                f"warning: the last {n} rollout{'s' if n > 1 else ''} gave every group of completions the same reward "
                f"(mean {float(rewards.mean()):.3g}), so every advantage is 0 and the policy does not change; start "
                "from a model that solves some prompts (model.init_from=<an SFT run>), raise objective.temperature or "
                "objective.num_generations, or add a reward that tells completions apart (data.rewards)"
            )

    def _logps(self, task: L.LightningModule, rows: Batch) -> torch.Tensor:
        """Per-token log-probs ``[R, T]`` of the rows' labels under the current model, without
        gradient, in runs of ``micro_batch_size`` rows (the same number of forwards on every rank)."""
        parts = []
        with task.trainer.precision_plugin.forward_context():
            for start in range(0, len(rows["input_ids"]), task.micro_batch_size):
                ids = rows["input_ids"][start : start + task.micro_batch_size]
                labels = rows["labels"][start : start + task.micro_batch_size]
                parts.append(token_logps(task.model(ids), labels, self.params.temperature))
        return torch.cat(parts)

    # ------------------------------------------------------------------------------ the loss
    def num_tokens(self, batch: Batch) -> torch.Tensor:
        """Units of ``batch``'s loss: rows (``grpo``, ``dr_grpo``) or completion tokens (``dapo``);
        for held-out answer rows (evaluation), their answer tokens."""
        mask = batch["labels"] != IGNORE_INDEX
        if "advantages" not in batch:
            return mask.sum().float()
        return count_units(mask, self.loss_type)

    def loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The summed policy loss of rollout rows; for held-out answer rows (evaluation), their NLL."""
        logits = model(batch["input_ids"], **model_inputs(model, batch))
        if "advantages" not in batch:
            return token_loss_sum(logits, batch["labels"])
        labels = batch["labels"]
        mask = labels != IGNORE_INDEX
        logps, entropy = token_logps_and_entropy(logits, labels, self.params.temperature)
        out = policy_loss(
            logps,
            batch.get("old_logps"),
            batch["advantages"],
            mask,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            importance=self.importance,
            beta=self.beta,
            ref_logps=batch.get("ref_logps"),
            aggregation=self.loss_type,
            max_completion_length=self.params.max_new_tokens,
        )
        for name, (total_, count) in out.sums.items():
            self._add(name, total_.detach(), count)
        self._add("entropy", torch.where(mask, entropy, 0.0).sum(), mask.sum())
        return out.loss_sum

    # ------------------------------------------------------------------------------ metrics
    def _add(self, name: str, value: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """Adds to a named sum and its count (device tensors stay on the device: no host sync)."""
        sums = self._sums.setdefault(name, [0.0, 0.0])
        sums[0] = sums[0] + value
        sums[1] = sums[1] + count

    def _record_rollout(
        self, rewards: Sequence[Any], values: dict[str, list[float]], total_: torch.Tensor,
        completions: Sequence[Sequence[int]], rollout_s: float,
    ) -> None:  # fmt: skip
        """The rollout's metrics, kept for the steps that reuse its rows (each step logs the rewards of
        the rows it trained on, whichever steps the loggers write); its sampling time once."""
        n, G = len(completions), self.num_generations
        self._reward_names = [r.name for r in rewards]
        groups = total_.view(-1, G)
        self._rollout_sums = {
            "reward": (float(total_.sum()), n),
            **{f"reward/{name}": (sum(v), n) for name, v in values.items()},
            "reward_std": (float(groups.std(dim=1).sum()), len(groups)),
            "zero_std_groups": (float((groups.max(1).values == groups.min(1).values).sum()), len(groups)),
            "completion_length": (float(sum(map(len, completions))), n),
            "truncated": (float(sum(len(c) >= self.params.max_new_tokens for c in completions)), n),
        }
        self._add_rollout_sums()
        self._add("time/rollout_s", rollout_s, 1)

    def _add_rollout_sums(self) -> None:
        for name, (value, count) in self._rollout_sums.items():
            self._add(name, value, count)

    def _names(self) -> list[str]:
        fixed = ["reward", *(f"reward/{n}" for n in self._reward_names), "reward_std", "zero_std_groups"]
        fixed += ["completion_length", "truncated", "time/rollout_s", "entropy", "ratio"]
        fixed += ["clip_ratio/low", "clip_ratio/high", "clip_ratio/region"] + (["kl"] if self.beta > 0 else [])
        return fixed + sorted(set(self._sums) - set(fixed))

    def pop_sums(self) -> tuple[list[str], torch.Tensor] | None:
        """``reward`` (and per function), ``reward_std`` (mean within-group std), ``zero_std_groups``
        (share of groups without a learning signal), ``completion_length`` (tokens),
        ``truncated`` (share that hit max_new_tokens), ``time/rollout_s``, ``entropy``, ``ratio``,
        ``clip_ratio/*`` and ``kl``: sums and counts since the last call (None before any)."""
        if not self._sums:
            return None
        names = self._names()
        device = next((v.device for pair in self._sums.values() for v in pair if isinstance(v, torch.Tensor)), None)
        sums = torch.stack(
            [
                torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(()) for v in pair])
                for pair in (self._sums.get(n, (0.0, 0.0)) for n in names)
            ],
            dim=1,
        )
        self._sums = {}
        return names, sums
