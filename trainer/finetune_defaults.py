"""Fine-tuning learning rates: a recipe's ``optim.lr`` that depends on what the run starts from.

plait's recipes are tuned for its own models trained from scratch on CPU (SFT at 3e-3); a
pretrained Hugging Face model fine-tuned at such a rate is ruined in a few steps. So a recipe
states three rates, ``optim.lr: ${plait.lr:<scratch>,<hub>,<hub with LoRA>}``: the first from
scratch or from a plait run (``model.init_from=runs/...``, a base trained at plait's scale), the
second from a Hugging Face directory (``model=hf model.init_from=DIR``, or a plait run of one:
TRL's defaults, 2e-5 for
SFT, 1e-6 for DPO and GRPO), the third from one with LoRA (adapters take about 10x: PEFT's and
LitGPT's LoRA recipes use 1e-4 to 3e-4). ``optim.lr=...`` on the command line replaces the
choice; `lr_line` says at launch which rate was taken and why.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def _from_hub(root: DictConfig) -> bool:
    """Whether the run starts from a Hugging Face directory (its ``config.json``), or from a plait
    run of one (``model.config_from``: `trainer.init_from.take_run_model`)."""
    init_from = OmegaConf.select(root, "model.init_from", default=None, throw_on_missing=False)
    if OmegaConf.select(root, "model.config_from", default=None, throw_on_missing=False):
        return True
    return isinstance(init_from, str) and (Path(init_from).expanduser() / "config.json").is_file()


def _lora(root: DictConfig) -> bool:
    return OmegaConf.select(root, "strategy.lora", default=None, throw_on_missing=False) is not None


def choose_lr(scratch: float, hub: float, hub_lora: float, *, _root_: DictConfig) -> float:
    """``${plait.lr:scratch,hub,hub_lora}``: the learning rate for what the run starts from (module doc)."""
    if not _from_hub(_root_):
        return float(scratch)
    return float(hub_lora if _lora(_root_) else hub)


def lr_line(cfg: DictConfig) -> str | None:
    """The launch line naming the learning rate a recipe chose (`choose_lr`), or None when
    ``optim.lr`` is not such a choice (set on the command line or by a recipe file as a number)."""
    node = cfg.get("optim")
    written = str(OmegaConf.to_container(node, resolve=False).get("lr")) if node is not None else ""
    if not written.startswith("${plait.lr:"):
        return None
    scratch, hub, hub_lora = written.removeprefix("${plait.lr:").rstrip("}").split(",")
    if not _from_hub(cfg):
        why = "from scratch or a plait run"
    else:
        why = "fine-tuning a Hugging Face model" + (" with LoRA" if _lora(cfg) else "")
    return (
        f"optim.lr={node.lr:g}: the {cfg.recipe} recipe's rate {why} (from scratch or a plait run, with or "
        f"without LoRA {float(scratch):g}; a Hugging Face model {float(hub):g}, with LoRA {float(hub_lora):g}); "
        "optim.lr=... sets another"
    )
