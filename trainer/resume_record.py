"""`ResumeRecord`: the callback that records a run in each of its checkpoints (`trainer.resume.run_record`)
and, at the start of a resumed fit, makes a resume's overridden optimizer values real
(`apply_overrides`) before it writes the run's ``config.yaml`` and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from trainer.data.chat import JinjaTemplate
from trainer.init_from import started_from
from trainer.resume import RECORD_KEY, RESUMES_FILE, read_record, run_record, tokenizer_fingerprint
from trainer.rundir import RunDir


class ResumeRecord(L.Callback):
    """Saves the `run_record` in every checkpoint; at the start of training (after Lightning
    restored a checkpoint) applies the overridden values and only then writes ``config.yaml``, the
    tokenizer and its chat template (rank 0, `RunDir.write_config`): a resume refused while
    loading leaves the run's files untouched.

    Args:
        cfg: this run's composed config.
        tokenizer: this run's tokenizer (``trainer.data.tokenizer.Tokenizer``).
        run_dir: the run directory.
        overrides: `check_resume`'s values (``{}`` for a fresh start).
        chat_template: the tokenizer's own template that goes with the model
            (`trainer.data.base.DataModule.model_chat_template`); None: plait's default.
        changes: on a resume, `resume_changes` (recorded as one line of ``resumes.jsonl``:
            the step, the checkpoint, ``{key: [old, new]}``).
        checkpoint: the checkpoint a resume starts from (None: a fresh start).
        data_fingerprint: the data module's `data_fingerprint` (None: not recorded).
        dp: the run's data-parallel degree (None: not recorded).
    """

    def __init__(
        self,
        cfg: DictConfig,
        tokenizer: Any,
        run_dir: Path,
        overrides: dict[str, Any],
        chat_template: JinjaTemplate | None = None,
        changes: dict[str, tuple[Any, Any]] | None = None,
        checkpoint: Path | None = None,
        data_fingerprint: str | None = None,
        dp: int | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.run_dir, self.overrides = cfg, tokenizer, Path(run_dir), overrides
        self.chat_template, self.changes, self.checkpoint = chat_template, changes or {}, checkpoint
        config = OmegaConf.to_container(cfg, resolve=True)
        # the weights the first step started from: the base's checkpoint now, or what the resumed one says
        resumed = read_record(checkpoint) if checkpoint is not None else None
        base = (
            (resumed or {}).get("base")
            if checkpoint is not None
            else started_from(OmegaConf.select(cfg, "model.init_from"))
        )
        self.record = run_record(config, tokenizer_fingerprint(tokenizer), data_fingerprint, dp, base)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.overrides:
            configs = trainer.lr_scheduler_configs
            optim = OmegaConf.to_container(self.cfg.optim, resolve=True)
            apply_overrides(trainer.optimizers[0], configs[0].scheduler if configs else None, self.overrides, optim)
        if trainer.is_global_zero:
            if self.checkpoint is not None:  # what this resume changed, beside the config.yaml it rewrites
                line = {"step": trainer.global_step, "checkpoint": str(self.checkpoint)}
                line["changed"] = {key: list(values) for key, values in self.changes.items()}
                with open(self.run_dir / RESUMES_FILE, "a", encoding="utf-8") as file:
                    file.write(json.dumps(line, default=str) + "\n")
            template = self.chat_template
            RunDir(self.run_dir).write_config(
                self.cfg,
                self.tokenizer,
                special_tokens=template.special if template else None,
                chat_template=template.source if template else None,
            )

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[RECORD_KEY] = self.record


def apply_overrides(
    optimizer: torch.optim.Optimizer, scheduler: Any, values: dict[str, Any], optim: dict[str, Any]
) -> None:
    """Makes overridden ``optim.*`` values real after Lightning restored the old optimizer state.

    The restored param groups hold the checkpoint's hyperparameters (and the scheduler scales
    the restored ``initial_lr``): each overridden field is written into every group that has it
    (``weight_decay`` only into the groups that decay). A group's learning rate is ``optim.<key>``,
    the key its optimizer's ``lr_key(group)`` names (``lr`` without one: Muon's AdamW groups follow
    ``adamw_lr``), or ``optim.lr`` while that key is null; when either is overridden it becomes the
    group's ``initial_lr`` (the scheduler's base), with the current ``lr`` recomputed by the scheduler.
    ``scheduler.*`` values are the new run's already (the current lr is recomputed) and
    ``train.max_grad_norm`` is read from the new config.

    Args:
        values: ``{"optim.lr": 1e-3, ...}`` of the overridden keys, the new run's values.
        optim: the new run's whole ``optim`` node (the keys a group's learning rate falls back on).
    """
    changed = {key.split(".", 1)[1]: value for key, value in values.items() if key.startswith("optim.")}
    lr_key_of = getattr(optimizer, "lr_key", None)  # an optimizer whose groups follow other keys (Muon)
    new_lr = False
    for group in optimizer.param_groups:
        lr_key = lr_key_of(group) if callable(lr_key_of) else "lr"
        for field, value in changed.items():
            if field in ("lr", lr_key):
                continue
            if field == "weight_decay":
                if group.get("weight_decay", 0.0) != 0.0:  # the no-decay group stays at 0
                    group["weight_decay"] = value
            elif field in group:
                group[field] = tuple(value) if isinstance(group[field], tuple) else value
        if "lr" in changed or lr_key in changed:
            own = optim.get(lr_key) if lr_key != "lr" else None
            group["initial_lr"] = group["lr"] = own if own is not None else optim["lr"]
            new_lr = True
    if scheduler is not None and (new_lr or any(key.startswith("scheduler.") for key in values)):
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, scheduler.get_lr()):
            group["lr"] = lr
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
