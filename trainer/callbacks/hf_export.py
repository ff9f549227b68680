"""Writes the trained model as a Hugging Face directory during or after training (`trainer.export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from strategies.core.resolved import ResolvedRun
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE
from trainer.export import write_hf_dir
from trainer.rundir import RunDir


class HFExport(L.Callback):
    """Hugging Face export of the model from the live (possibly sharded) run.

    Every rank takes part in gathering the full weights (FSDP/TP shards, on CPU); rank 0 writes.
    ``plait export ckpt=...`` does the same from a checkpoint after the run.

    Args:
        dirpath: the run directory (the trainer sets it); exports go to ``<dirpath>/hf`` (end of
            training) and ``<dirpath>/hf_step_<N>`` (periodic).
        at_end: export when training ends.
        every_n_steps: also export every this many optimizer steps (0: never).
        dtype: "float32", "bfloat16" or "float16"; None keeps the parameters' dtype.
        max_shard_mb: safetensors shard size.
        model_sources: the Hugging Face directories whose ``config.json``, generation and tokenizer
            files describe the model (`trainer.hf_sources.source_dirs` of the run's config: the builder
            passes them, so the export is ``plait export``'s, a chain's ``model.config_from``
            included); None (built by hand): none.
        config_sources: those whose ``config.json`` is the model's (``source_dirs(tokenizer=False)``:
            not a tokenizer's folder); None: ``model_sources``.

    Layouts it cannot export from (pipeline stages, LoRA adapters) are refused before launch (`problems`).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        at_end: bool = False,
        every_n_steps: int = 0,
        dtype: str | None = None,
        max_shard_mb: float = 5000.0,
        model_sources: list[str] | None = None,
        config_sources: list[str] | None = None,
    ) -> None:
        self.dirpath = Path(dirpath) if dirpath else Path(".")
        self.model_sources = [Path(p) for p in model_sources or ()]
        self.config_sources = None if config_sources is None else [Path(p) for p in config_sources]
        self.at_end, self.every_n_steps = at_end, every_n_steps
        self.dtype, self.max_shard_mb = dtype, max_shard_mb

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """What keeps an export during the run from being written (validate asks before launch):
        pipeline parallelism (each rank holds one stage) and LoRA (the live model holds adapters
        beside a frozen base; ``plait export`` merges them from a checkpoint)."""
        if run is None or not (node.get("at_end") or node.get("every_n_steps")):
            return []
        off = " ".join(
            f"callbacks.hf_export.{k}={v}" for k, v in (("at_end", "false"), ("every_n_steps", 0)) if node.get(k)
        )
        problems = []
        if run.dims.pp > 1:
            problems.append(
                f"callbacks.hf_export needs pp=1 (strategy.pp={run.dims.pp}: each pipeline rank holds one stage); "
                f"export after the run with plait export ckpt=<run dir> out=<dir>, or {off}"
            )
        if run.adapters:
            problems.append(
                "callbacks.hf_export does not merge LoRA adapters; export after the run with plait export "
                f"ckpt=<run dir> out=<dir> (the merged model and the PEFT adapter), or {off}"
            )
        return problems

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0:
            with pl_module.off_step():  # not training time (summary.json's tokens/s)
                self.export(trainer, pl_module, RunDir(self.dirpath).hf_step(step))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_end:
            self.export(trainer, pl_module, RunDir(self.dirpath).hf)

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Path) -> None:
        """Gathers the full weights (collective) and writes ``out`` on rank 0."""
        model = pl_module.model
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            data = trainer.datamodule
            template = data.model_chat_template()  # the one the data rendered with: the run's
            write_hf_dir(
                out,
                model=model,
                state=state,
                tokenizer=data.tokenizer,
                sources=self.model_sources,
                dtype=self.dtype,
                max_shard_mb=self.max_shard_mb,
                chat_template=DEFAULT_CHAT_TEMPLATE if template is None else template.source,
                config_sources=self.config_sources,
            )
        if dist.is_initialized():
            dist.barrier()
