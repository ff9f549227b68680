"""`MeshCheckpoints`: the checkpoint format of `strategies.mesh.MeshStrategy` (DCP, resharded on load).

Lightning gathers the model and optimizer state into one dict before ``save_checkpoint``; a sharded
layout instead lets DCP write each rank's shards once, so the two state hooks return nothing and
``save_checkpoint``/``load_checkpoint`` hand the live model and optimizers to `strategies.checkpoint`
(or to the local-SGD plugin, which keeps each island's state and its own).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from strategies import checkpoint as ckpt
from strategies.lora_targets import is_adapter


class MeshCheckpoints:
    """Checkpoint methods mixed into `MeshStrategy` (before Lightning's strategy in its bases).

    Uses the strategy's ``lightning_module``, ``optimizers``, ``broadcast``, ``is_global_zero``,
    ``local_sgd`` and ``lora``.
    """

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # gathered by DCP in save_checkpoint, once

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # gathered by DCP in save_checkpoint, once

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("MeshStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        if self.local_sgd is not None:  # each island's state, the plugin's own state
            self.local_sgd.save_checkpoint(
                path, model=self.lightning_module.model, optimizers=self._unwrapped_optimizers(), meta=checkpoint
            )
            return
        ckpt.save(
            path, model=self.lightning_module.model, optimizers=self._unwrapped_optimizers(), meta=checkpoint,
            keys=self._saved_keys(),
        )  # fmt: skip

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.local_sgd is not None:
            return self.local_sgd.load_checkpoint(
                path, model=self.lightning_module.model, optimizers=self._unwrapped_optimizers()
            )
        return ckpt.load(
            path, model=self.lightning_module.model, optimizers=self._unwrapped_optimizers(), keys=self._saved_keys()
        )

    def _saved_keys(self) -> Callable[[str], bool] | None:
        """Which model state a checkpoint holds: with LoRA only the adapters (the frozen base is
        ``model.init_from``'s, loaded again on resume); else everything (None)."""
        return is_adapter if self.lora is not None else None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def _unwrapped_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(opt, "_optimizer", opt) for opt in self.optimizers]
