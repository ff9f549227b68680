"""lm-evaluation-harness tasks during training: ``eval/<task>/<metric>`` in the step's row.

``callbacks.lm_eval.every_n_steps=N`` scores the live model on ``callbacks.lm_eval.tasks`` (the
bundled ``plait_bundled`` by default) before the first step, every N optimizer steps and after the
last (also when the data or a budget ends the run early: then in a row of its own), through
`trainer.evaluators.plait_lm.PlaitLM`, in windows of the rows the run trains on
(``data.seq_len``) unless ``max_length`` says otherwise; rank 0 also writes
``<run>/eval/step_<N>.json`` as ``plait eval`` does. Every rank answers every request (an FSDP forward needs every rank: the
ranks compute the same scores), in eval mode, without gradients, in the precision's forward
context; Python's, NumPy's and torch's generators are left as they were, so training draws the
same numbers with and without the callback. Layouts that do not give each rank whole sequences
(pp, cp, sequence-parallel tp) are refused by `LMEval.problems` before launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from strategies.core.resolved import ResolvedRun
from trainer.data.answer_end import turn_end_ids
from trainer.eval import EVAL_DIR, write_scores


class LMEval(L.Callback):
    """Scores lm-eval tasks every ``every_n_steps`` optimizer steps (see the module docstring).

    Args:
        dirpath: the run directory (the trainer sets it); scores go to ``<dirpath>/eval``.
        every_n_steps: evaluate every this many optimizer steps, and at steps 0 and the last (0: never).
        tasks: lm-eval task or group names.
        include_path: directories of your own task files.
        limit: at most this many documents per task (a fraction < 1: that share); None: all.
        num_fewshot: examples per prompt (None: each task's default).
        batch_size: requests per forward (its logits are ``batch_size x max_length x vocab``).
        max_length: the context in tokens; None: the data's ``seq_len`` (at most the model's ``max_seq_len``).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int = 0,
        tasks: Sequence[str] = ("plait_bundled",),
        include_path: Sequence[str] = (),
        limit: float | None = None,
        num_fewshot: int | None = None,
        batch_size: int = 4,
        max_length: int | None = None,
    ) -> None:
        self.dirpath = Path(dirpath) if dirpath else Path(".")
        self.every_n_steps, self.tasks, self.include_path = every_n_steps, list(tasks), list(include_path)
        self.limit, self.num_fewshot, self.batch_size, self.max_length = limit, num_fewshot, batch_size, max_length
        self._manager: Any = None  # lm-eval's task index, built once
        self._scored_step: int | None = None

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """What keeps the node's settings from running: a negative period, no task, or a layout
        without whole sequences on every rank (each request is one forward of a whole sequence)."""
        every = node.get("every_n_steps", 0)
        if not isinstance(every, int) or every < 0:
            return [f"callbacks.lm_eval.every_n_steps={every} must be an integer >= 0 (0: off)"]
        if not every:
            return []
        if not node.get("tasks"):
            return ["callbacks.lm_eval.tasks is empty; name lm-eval tasks (or callbacks.lm_eval.every_n_steps=0)"]
        if node.get("batch_size", 4) < 1:
            return [f"callbacks.lm_eval.batch_size={node.get('batch_size')} must be >= 1"]
        missing = [str(p) for p in node.get("include_path") or () if not Path(str(p)).expanduser().is_dir()]
        if missing:
            return [f"callbacks.lm_eval.include_path: {', '.join(missing)} is not a directory of lm-eval task files"]
        from trainer.evaluators.lm_harness import TaskNotFoundError, task_manager  # lm-eval: for runs using it only

        try:
            task_manager(list(node.tasks), [str(p) for p in node.get("include_path") or ()])
        except TaskNotFoundError as err:
            return [f"callbacks.lm_eval.tasks: {err}"]
        if run is None:
            return []
        split = [f"strategy.{axis}={getattr(run.dims, axis)}" for axis in ("pp", "cp") if getattr(run.dims, axis) > 1]
        if run.sequence_parallel:
            split.append("strategy.tensor_parallel.sequence_parallel=true")
        if split:
            return [
                f"callbacks.lm_eval scores whole sequences on every rank, which {' and '.join(split)} does not give; "
                "evaluate after the run with plait eval ckpt=<run> (or callbacks.lm_eval.every_n_steps=0)"
            ]
        return []

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The model before the first step, scored once the Task's on_train_start has run (Lightning calls the
        # callbacks' first): a restarted replica group has joined by then and is past step 0 (nothing to score).
        if self.every_n_steps and self._scored_step is None and trainer.global_step == 0:
            self._log(trainer, self.evaluate(trainer, pl_module, record=False))

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps and (step % self.every_n_steps == 0 or step == trainer.max_steps):
            with pl_module.off_step():  # not training time (summary.json's tokens/s)
                self.evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run the data or a budget ended before max_steps: its last step is scored here, in a row of its own.
        if self.every_n_steps and self._scored_step != trainer.global_step:
            self._log(trainer, self.evaluate(trainer, pl_module, record=False))

    @staticmethod
    def _log(trainer: L.Trainer, scores: dict[str, float]) -> None:
        """``eval/<task>/<metric>`` in a row of their own at the current step (outside a step's row)."""
        if scores:
            for logger in trainer.loggers:
                logger.log_metrics({f"eval/{name}": value for name, value in scores.items()}, step=trainer.global_step)
                logger.save()

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule, *, record: bool = True) -> dict[str, float]:
        """Runs the tasks on every rank and (``record``) records ``eval/<task>/<metric>`` in the
        step's row; rank 0 writes ``<dirpath>/eval/step_<N>.json``. Returns the flat scores (rank 0's;
        {} on the other ranks of its node, where lm-eval reports nothing)."""
        from trainer.evaluators.lm_harness import evaluate_tasks, task_manager  # lm-eval: runs using it only
        from trainer.evaluators.plait_lm import PlaitLM  # lm-eval: runs using it only

        data = trainer.datamodule
        template = data.model_chat_template() if hasattr(data, "model_chat_template") else None
        model_len = pl_module.model.max_seq_len
        max_length = min(self.max_length or getattr(data, "seq_len", None) or model_len, model_len)
        lm = PlaitLM(
            pl_module.model,
            data.tokenizer,
            device=pl_module.device,
            batch_size=self.batch_size,
            max_length=max_length,
            chat_template=(lambda m, gen: template.render(m, add_generation_prompt=gen)) if template else None,
            all_done=_all_ranks_done(pl_module.device) if dist.is_initialized() else None,
            stop_ids=turn_end_ids(data.tokenizer, template),
            kv_cache=not dist.is_initialized(),  # the cache is one process's: sharded weights decode without it
        )
        if self._manager is None:
            self._manager = task_manager(self.tasks, self.include_path)
        was_training = pl_module.model.training
        pl_module.model.eval()
        try:
            with trainer.precision_plugin.forward_context():
                scores, results = evaluate_tasks(
                    lm, self.tasks, limit=self.limit, num_fewshot=self.num_fewshot, manager=self._manager
                )
        finally:
            pl_module.model.train(was_training)
        step = self._scored_step = trainer.global_step
        if record:
            pl_module.record({f"eval/{name}": value for name, value in scores.items()})
        if trainer.is_global_zero:
            settings = {"limit": self.limit, "num_fewshot": self.num_fewshot, "max_length": max_length}
            write_scores(self.dirpath / EVAL_DIR, f"step_{step:07d}", step, scores, results.get("results"), settings)
        return scores


def _all_ranks_done(device: torch.device) -> Callable[[bool], bool]:
    """`trainer.batch_sampling.sample_batch`'s ``all_done`` for collective forwards: decoding goes on until
    every rank's rows have finished (their greedy decodes match, but a near tie may split them)."""

    def done(mine: bool) -> bool:
        flag = torch.tensor([int(mine)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    return done
