"""`Task`: the LightningModule that owns the whole optimizer step.

One optimizer step, in order:

1. Split this rank's rows of the global batch into micro-batches.
2. Count supervised tokens over all micro-batches and all dp x cp ranks *before* the first
   backward (one all-reduce). Each micro-batch loss = its summed token loss / that global count,
   so gradient accumulation and data parallelism equal one big batch (cases C01, C02, C03, C05).
3. Forward/backward of every micro-batch: ``strategy.forward_backward`` (pipeline parallelism
   replaces it with its schedule).
4. Global gradient norm over all shards, replicas and stages; clip; optimizer step; the LR
   scheduler steps once per optimizer step (cases C06, C13, C14).
5. ``strategy.after_optimizer_step`` (local-SGD synchronisations and their bytes), data
   position, metrics.

Lightning still runs the loop, callbacks, loggers, checkpoint triggers and launchers; automatic
optimization is off because its closure scales losses by a fixed ``1/accumulate_grad_batches``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from strategies.core.model_contract import model_inputs
from strategies.transforms.lora import quantize_pending
from trainer import held_out
from trainer.data import accounting
from trainer.init_from import load_init_from
from trainer.loggers import is_logging_step
from trainer.nonfinite import ADMITTED, NonFiniteError, NonFiniteGuard
from trainer.off_step import OffStepClock
from trainer.optim import build_optimizer
from trainer.protocols import Objective, RoutedModel
from trainer.rollback import roll_back
from trainer.run_length import RunLength, plan_run_length
from trainer.rundir import RunDir
from trainer.step_metrics import NamedMeans, PendingSteps


class Task(L.LightningModule):
    """Trains ``model`` on ``objective`` with one owner of the optimizer step.

    Args:
        model: the network (parallelized in place by the strategy in ``configure_model``).
        objective: a `trainer.protocols.Objective` (``num_tokens``, ``loss_sum``, ``pop_sums``,
            ``before_fit``; see trainer.objectives).
        optimizer: partial taking parameter groups (Hydra ``_partial_: true``).
        scheduler: partial taking the optimizer and ``total_steps``; None for a constant LR.
        micro_batch_size: rows per forward/backward on each dp rank.
        max_grad_norm: clip the global gradient norm to this; None or 0 disables clipping.
        weight_decay: decay of matmul weights; embeddings, norms and biases get 0 (case C16).
        no_decay: substrings of parameter names that get no weight decay.
        eval_every: evaluate every this many optimizer steps, at step 0 and at the last step
            (0: only at the last step).
        flops_per_token: training FLOPs per token of the model, for throughput reporting.
        nonfinite: decides whether a step is applied: not when its loss or gradient norm is NaN,
            inf or a spike (`trainer.nonfinite.NonFiniteGuard`); None: the default guard.
        init_from: the weights the model starts from (``model.init_from``: a Hugging Face directory
            or a plait checkpoint / run), loaded in `configure_model` after parallelizing; None
            keeps the model's initialisation.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        objective: Objective,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None,
        micro_batch_size: int,
        max_grad_norm: float | None,
        weight_decay: float,
        no_decay: tuple[str, ...],
        eval_every: int,
        flops_per_token: float,
        nonfinite: NonFiniteGuard | None = None,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = model
        self.objective = objective
        self.optimizer_fn, self.scheduler_fn = optimizer, scheduler
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.weight_decay, self.no_decay = weight_decay, tuple(no_decay)
        self.eval_every = eval_every
        self.flops_per_token = flops_per_token
        self.nonfinite = nonfinite or NonFiniteGuard()
        self.init_from = init_from
        # Run state, saved in checkpoints (on_save_checkpoint).
        self.tokens_seen = 0
        self.off_step = OffStepClock()  # evaluations, saves, exports between steps (summary.json's tokens/s)
        self._history: list[dict[str, Any]] = []  # see `history`
        self._pending = PendingSteps()  # steps whose device values are not read yet
        self.last_step_tokens = 0
        self._row: dict[str, float] = {}  # the loggers' row of the current step (see `record`)
        self._configured = False  # configure_model has parallelized the model
        self._run_length: RunLength | None = None  # see `run_length`

    # ------------------------------------------------------------------------------ setup
    @override
    def configure_model(self) -> None:
        # Lightning calls this hook at every fit/validate/test; the model is parallelized once.
        if self._configured:
            return
        # Models declare their structure; the strategy applies the layout.
        self.trainer.strategy.parallelize(self.model)
        # Pretrained weights go straight into the shards: each rank reads only what it holds.
        load_init_from(self.model, self.init_from)
        quantize_pending(self.model)  # QLoRA: the loaded base becomes 4-bit (before FSDP2's first forward)
        self._configured = True

    @override
    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(
            self.model, self.optimizer_fn, weight_decay=self.weight_decay, no_decay=self.no_decay
        )
        if (run_length := getattr(self.trainer.strategy, "run_length", None)) is not None:
            run_length(self.total_steps())  # the plugins' schedules span the steps the LR schedule spans
        if self.scheduler_fn is None:
            return optimizer
        scheduler = self.scheduler_fn(optimizer, total_steps=self.total_steps())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def run_length(self) -> RunLength:
        """The planned length of the run (`trainer.run_length`): ``trainer.max_steps``, or fewer
        when the data ends first (`DataModule.finite_steps`, e.g. an SFT mixture whose budgets
        end the run; a Task fitted without a data module runs ``max_steps``). Resolved once."""
        if self._run_length is None:
            self._run_length = plan_run_length(self.trainer.max_steps, self.trainer.datamodule)
        return self._run_length

    def total_steps(self) -> int:
        """Optimizer steps of the run (`run_length`)."""
        return self.run_length().planned_steps

    def data_ended(self) -> bool:
        """Whether the train loader has reached the end of finite data (it then says ``exhausted``)."""
        return self.trainer.train_dataloader.exhausted

    def headline_metrics(self) -> list[str]:
        """The validation metrics that measure whether this run learns, beyond the loss: the
        objective's (`Objective.headline_metrics`, as ``val/<name>``), then each evaluator's
        (`Evaluator.headline_metrics`, e.g. ``val/exact_match/<source>``)."""
        names = [f"val/{name}" for name in getattr(self.objective, "headline_metrics", ())]
        datamodule = self.trainer.datamodule
        for evaluator in datamodule.evaluators() if datamodule is not None else ():
            names += [name for name in getattr(evaluator, "headline_metrics", ()) if name not in names]
        return names

    def pop_means(self, prefix: str) -> list[NamedMeans]:
        """``{prefix}/<name>``: `_reduced_sums` each divided by its count on the device (`NamedMeans`;
        names whose count is 0 are left out when read); the held-out evaluation reads them
        (`trainer.held_out.evaluate`)."""
        return [NamedMeans.of_sums(prefix, names, sums) for names, sums in self._reduced_sums()]

    def _reduced_sums(self) -> list[tuple[list[str], torch.Tensor]]:
        """The named sums since the last call of the objective and, for a `RoutedModel`, of the
        model (`Objective.pop_sums`: e.g. the loss per SFT source, the rewards per preference pair,
        the expert loads), each ``(names, [2, n] fp32 sums and counts)`` reduced over all dp x cp
        ranks and the pipeline stages (only the last one computes the loss; each holds its own MoE
        blocks) of this world."""
        strategy = self.trainer.strategy
        reduced = []
        for source in (self.objective, self.model) if isinstance(self.model, RoutedModel) else (self.objective,):
            popped = source.pop_sums()
            if popped is None:
                continue
            names, sums = popped
            sums = strategy.all_reduce_sum(sums.to(self.device).float(), "dp_cp")
            if strategy.dims.pp > 1:
                sums = strategy.all_reduce_sum(sums, "pp")
            reduced.append((list(names), sums))
        return reduced

    @property
    def history(self) -> list[dict[str, Any]]:
        """The run's steps and evaluations, oldest first: ``{"step", "loss", "grad_norm", "lr",
        <metrics>}`` per optimizer step, ``{"step", "val_loss"[, "metrics"]}`` per evaluation.
        Reading it reads the pending steps' device values (one host sync)."""
        self._read_pending()
        return self._history

    @history.setter
    def history(self, entries: list[dict[str, Any]]) -> None:
        self._pending = PendingSteps()
        self._history = list(entries)

    def _read_pending(self) -> None:
        """Converts the pending steps (one transfer) into history entries; steps whose update was
        skipped on the device are counted in order (`NonFiniteGuard.admit`, which raises
        `NonFiniteError` when a run of them stops the run)."""
        if not len(self._pending):
            return
        for entry in self._pending.read():
            skipped_on_device, verdict = entry.pop("_skip_on_device", False), entry.pop("_verdict", None)
            tokens_seen = entry.pop("_tokens_seen")
            if skipped_on_device:
                step, checkpoints = int(entry["step"]), self._checkpoints()
                with self._stopping_step(entry, tokens_seen):
                    self.nonfinite.admit(step, entry["loss"], entry["grad_norm"], verdict, checkpoints=checkpoints)
            self._history.append(entry)

    @contextmanager
    def _stopping_step(self, entry: dict[str, Any], tokens_seen: int) -> Iterator[None]:
        """When the guard stops the run on the step of ``entry`` (`NonFiniteError`), that step is
        the last of the history and of the loggers' rows (its loss, grad norm and the anomalous
        steps counted), as summary.json's figures are: the run's files end on the step that stopped
        it, ``tokens_seen`` (the tokens up to it) too, whether the verdict was read at once (a host
        verdict) or at a later logging step (a fused optimizer's, after more steps ran)."""
        try:
            yield
        except NonFiniteError:
            self.tokens_seen = tokens_seen
            self._history.append(entry)
            self._row = {
                "train/loss": entry["loss"],
                "train/grad_norm": entry["grad_norm"],
                "train/lr": entry["lr"],
                "train/nonfinite_steps": float(self.nonfinite.skipped),
            }
            self._write_row(step=int(entry["step"]))
            raise

    def _checkpoints(self) -> Path:
        """The run's ``checkpoints/`` directory (named in the advice of a stopped run)."""
        return RunDir(self.trainer.default_root_dir).checkpoints

    # ------------------------------------------------------------------------------ the step
    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        strategy = self.trainer.strategy
        optimizer = self.optimizers()
        batch = self.objective.step_rows(self, batch)  # an online objective samples its rows here
        # before a cp rank keeps its slice; every replica group's share (fault tolerance) counted
        step_tokens = batch["input_ids"].numel() * strategy.train_sampler_kwargs["num_replicas"]
        micro_batches = strategy.micro_batches(batch, self.micro_batch_size)  # e.g. each cp rank's slices
        num_tokens = self._count_tokens(micro_batches)
        # A step without supervised tokens contributes exactly 0 gradient, never 0/0 = NaN.
        denominator = num_tokens.clamp(min=1.0)

        def loss_fn(model: nn.Module, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.objective.loss_sum(model, micro_batch) / denominator

        local_loss = strategy.forward_backward(self.model, micro_batches, loss_fn, self.manual_backward)
        loss = strategy.all_reduce_sum(local_loss, strategy.token_axis)
        named_sums = self._reduced_sums()  # e.g. per-source losses, preference rewards
        if strategy.token_axis != "dp_cp":
            # Local-SGD islands each divide by their own tokens: log the token-weighted mean of all islands.
            totals = strategy.all_reduce_sum(torch.stack([loss * num_tokens, num_tokens]), "dp_replicate")
            loss, num_tokens = totals[0] / totals[1].clamp(min=1.0), totals[1]

        parameters = [p for p in self.model.parameters() if p.requires_grad]
        # Replica groups (fault tolerance) sum their gradients, loss and named sums here; an update a
        # group cannot commit is dropped.
        loss, commit = strategy.reduce_gradients(parameters, loss, [sums for _, sums in named_sums])
        objective_sums = [NamedMeans.of_sums("train", names, sums) for names, sums in named_sums]
        values, verdict, on_device = self._judge(optimizer, parameters, loss, num_tokens, commit, step_tokens)
        lr, strategy_metrics = self._update(optimizer, loss)

        # A loader may report data metrics of the trained position (per-source consumed tokens).
        data_metrics = self.trainer.train_dataloader.mark_trained() or {}
        if self._last_step() and (end_training := getattr(strategy, "end_training", None)) is not None:
            # e.g. IST reassembles its narrow subnets: before the step's callbacks (an export, an
            # lm-eval score, the checkpoint), which Lightning runs after this method, and the last evaluation
            end_training(self.model)
        self.last_step_tokens = step_tokens
        self.tokens_seen += self.last_step_tokens
        self._pending.add(
            {
                "step": self.global_step,
                "loss": values[0],
                "grad_norm": values[1],
                "lr": lr,
                "_skip_on_device": on_device,
                "_verdict": verdict,
                "_tokens_seen": self.tokens_seen,
                f"train/{getattr(self.objective, 'step_count_name', 'supervised_tokens')}": num_tokens,
                **strategy_metrics,
                **data_metrics,
            },
            objective_sums,
        )
        if is_logging_step(self.trainer) or self._evaluates_now():
            self._log_read_steps()

    def _count_tokens(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The step's loss divisor (the objective's `num_tokens` over the micro-batches of every rank
        that shares the gradient: dp x cp, one island's under local SGD, and the replica groups of
        fault tolerance), counted before the first backward; sets a routed model's router-loss scale."""
        strategy = self.trainer.strategy
        num_tokens = torch.stack([self.objective.num_tokens(mb) for mb in micro_batches]).sum()
        if not isinstance(self.model, RoutedModel):
            num_tokens = strategy.all_reduce_sum(num_tokens.to(self.device), strategy.token_axis)
            return strategy.reduce_tokens(num_tokens)  # replica groups (fault tolerance): theirs too
        # Router losses average over the step's routed tokens (padding is not routed: model_inputs)
        # on every rank that shares the gradient; one all-reduce for both counts.
        masks = [model_inputs(self.model, mb).get("token_mask_bt") for mb in micro_batches]
        routed = sum(float(mb["input_ids"].numel()) if m is None else m.sum() for mb, m in zip(micro_batches, masks))
        both = torch.stack(
            [num_tokens.double(), torch.as_tensor(routed, dtype=torch.float64, device=num_tokens.device)]
        )
        counts = strategy.all_reduce_sum(both.to(self.device), strategy.token_axis)
        self.model.set_router_loss_scale(1.0 / max(float(counts[1]), 1.0))
        return strategy.reduce_tokens(counts[0].float())  # replica groups (fault tolerance): theirs too

    def _judge(
        self,
        optimizer: Any,
        parameters: list[nn.Parameter],
        loss: torch.Tensor,
        num_tokens: torch.Tensor,
        commit: bool,
        step_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Whether the step's update is applied, decided before the optimizer step: the gradient
        norm, the guard's verdict on the loss and norm (`NonFiniteGuard`), gradients zeroed when it
        is refused (so the optimizer leaves every parameter as it is), clipped otherwise.

        Returns:
            ``(values [loss, grad_norm], verdict, on_device)``: ``on_device`` when the verdict is
            applied on the device without a host read (`NonFiniteGuard.skip_on_device`).
        """
        strategy = self.trainer.strategy
        grad_norm = strategy.grad_norm(parameters)
        islands = None if strategy.token_axis == "dp_cp" else lambda t: strategy.all_reduce_sum(t, "dp_replicate")
        values = self.nonfinite.combine(loss, grad_norm, islands=islands)
        if not commit:  # the replica groups dropped this update (a failed all-reduce: partial values): not judged
            optimizer.zero_grad(set_to_none=True)
            return values, torch.full_like(values[0], ADMITTED), False
        verdict = self.nonfinite.verdict(values, judged=num_tokens > 0, islands=islands)
        on_device = self.nonfinite.skip_on_device(getattr(optimizer, "_optimizer", optimizer), verdict)
        if not on_device:
            self._read_pending()  # the steps before, so that a stop on this one is the history's last
            loss_f, grad_norm_f, verdict_f = torch.cat([values, verdict.reshape(1)]).tolist()
            entry = {"step": self.global_step + 1, "loss": loss_f, "grad_norm": grad_norm_f}
            with self._stopping_step({**entry, "lr": optimizer.param_groups[0]["lr"]}, self.tokens_seen + step_tokens):
                admitted = self.nonfinite.admit(*entry.values(), verdict_f, checkpoints=self._checkpoints())
        if not on_device and not admitted:
            optimizer.zero_grad(set_to_none=True)
        elif self.max_grad_norm:  # (a skipped step's NaN gradients: its update is skipped anyway)
            strategy.clip_grads(parameters, max_norm=self.max_grad_norm, total_norm=grad_norm)
        return values, verdict, on_device

    def _update(self, optimizer: Any, loss: torch.Tensor) -> tuple[float, dict[str, Any]]:
        """The optimizer and LR-scheduler steps, then the strategy's work after them (local-SGD
        synchronisations). Returns the step's learning rate and the strategy's metrics (e.g. bytes sent)."""
        strategy = self.trainer.strategy
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        if (observe_loss := getattr(strategy, "observe_loss", None)) is not None:
            observe_loss(self.global_step, loss)  # before the step's plugin work (DASO's plateau rule)
        return lr, strategy.after_optimizer_step(self.model, self.global_step, optimizer)

    def _last_step(self) -> bool:
        """Whether the step just done is the run's last: ``trainer.max_steps`` reached or the data ended."""
        return self.global_step == self.trainer.max_steps or self.data_ended()

    def _evaluates_now(self) -> bool:
        """Whether the step just done ends with an evaluation (`end_step`)."""
        return self._last_step() or bool(self.eval_every and self.global_step % self.eval_every == 0)

    def _log_read_steps(self) -> None:
        """Reads the pending steps (the one host sync of the steps since the last read) and,
        on a logging step, records the latest one for the loggers and the progress bar.

        Called at the end of logging and evaluation steps: the throughput callback's step times
        then include the accelerator's work of the steps since the last read."""
        self._read_pending()
        last = dict(self._history[-1])
        # Every value is already global and equal on all ranks: no sync_dist (which would also
        # deadlock under pipeline parallelism, where every rank must log the same keys).
        self.log("train/loss", last["loss"], prog_bar=True, logger=False)  # progress bar and callback_metrics
        if not (is_logging_step(self.trainer) or self.data_ended()):
            return
        step, loss, grad_norm, lr = (last.pop(k) for k in ("step", "loss", "grad_norm", "lr"))
        if self.nonfinite.skipped:  # every anomalous step: non-finite or spike
            last["train/nonfinite_steps"] = float(self.nonfinite.skipped)
        self.record(
            {
                "train/loss": loss,
                "train/grad_norm": grad_norm,
                "train/lr": lr,
                **last,
                "train/tokens_seen": float(self.tokens_seen),
            }
        )

    # ------------------------------------------------------------------------------ logging
    def record(self, metrics: dict[str, float]) -> None:
        """Adds values to the loggers' row of the current optimizer step.

        The row is written once, at the end of the step, with ``step`` = optimizer steps done: the
        train loss of step k, the validation loss after step k and the throughput of step k share
        row k, and the validation loss before training is row 0. (Lightning's own ``self.log``
        rows count from 0 for the first step and cannot be written from ``on_train_start``.)
        """
        self._row.update(metrics)

    def _write_row(self, step: int | None = None) -> None:
        """Writes the row recorded so far at ``step`` (None: the optimizer steps done)."""
        if self._row:
            row = {**self._row, "epoch": float(self.current_epoch)}
            for logger in self.loggers:
                logger.log_metrics(row, step=self.global_step if step is None else step)
                logger.save()
            self._row = {}

    # ------------------------------------------------------------------------------ evaluation
    @override
    def on_fit_start(self) -> None:
        # What depends on the initial model, computed with the parallelized policy before the
        # first step (a preference objective's reference log-probs); a restored run keeps its own.
        self.objective.before_fit(self)

    @override
    def on_train_start(self) -> None:
        # Replica groups join first: a restarted group takes the others' state and step (no evaluation of its fresh weights).
        if (join_worlds := getattr(self.trainer.strategy, "join_worlds", None)) is not None:
            join_worlds(self.trainer)
        datamodule = self.trainer.datamodule
        if self.global_step == 0 and datamodule is not None:  # what preparation cut, once, in row 0
            self.record(accounting.metrics(datamodule.data_counts()))
        if self.global_step == 0 and not any("val_loss" in h for h in self.history):
            self.evaluate()
        self._write_row()

    @override
    def configure_callbacks(self) -> list[L.Callback]:
        # The end of each step runs as a callback: after the configured callbacks (throughput has
        # recorded its values) and before checkpoint callbacks, which Lightning runs last, so a
        # step's row is on disk before its checkpoint exists.
        return [_EndOfStep()]

    def end_step(self) -> None:
        """Rolls back when the guard says so (`trainer.rollback.roll_back`), evaluates when due and writes the
        step's row to the loggers."""
        if self.nonfinite.policy == "rollback":
            self._read_pending()  # this step's verdict now: a host read each step, under rollback only
        if self.nonfinite.rollback_due is not None:
            with self.off_step():  # a reload, not training (summary.json's tokens/s)
                roll_back(self)
        if self._evaluates_now():
            with self.off_step():
                self.evaluate()
        self._write_row()

    @override
    def on_train_epoch_end(self) -> None:
        # Finite data (an SFT mixture whose budgets are spent) ends the run, not another epoch.
        if self.data_ended():
            self.trainer.should_stop = True

    def evaluate(self) -> float | None:
        """The held-out loss and the data's evaluators' scores, recorded in the step's row (`held_out.evaluate`)."""
        return held_out.evaluate(self)

    @property
    def latest_val_loss(self) -> float | None:
        """The validation loss of the newest evaluation (restored runs too), None before any.

        Read by the progress bar at every redraw: evaluations go straight into the history, so this
        leaves the pending steps on the device (no host sync)."""
        return next((entry["val_loss"] for entry in reversed(self._history) if "val_loss" in entry), None)

    # ------------------------------------------------------------------------------ state
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["plait"] = {
            "tokens_seen": self.tokens_seen, "history": list(self.history), "nonfinite": self.nonfinite.state_dict()
        }  # fmt: skip

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["plait"]
        self.tokens_seen, self.history = state["tokens_seen"], list(state["history"])
        self.nonfinite.load_state_dict(state["nonfinite"])


class _EndOfStep(L.Callback):
    """Calls `Task.end_step` at the end of every training step (see `Task.configure_callbacks`)."""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        assert isinstance(pl_module, Task)
        pl_module.end_step()
