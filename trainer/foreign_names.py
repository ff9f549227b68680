"""Option names users bring from TRL, LitGPT and torchtune, each with the plait override it means.

An override whose key plait does not know is refused naming plait's (`trainer.overrides`):
``plait sft learning_rate=2e-5`` -> ``use optim.lr=2e-5``. `FOREIGN_NAMES` is the one table; a
name matches a whole key (``optimizer.lr``) or the last part of one (``optim.learning_rate``,
``training.per_device_train_batch_size``). ``{value}`` in a row is the value the user typed.
Strategy keys that moved into their plugin's node (`strategies.moved_keys`) are found the same way.
Imports nothing heavy: a refused override is answered before torch loads.
"""

from __future__ import annotations

from strategies.moved_keys import MOVED_KEYS

# plait counts optimizer steps; an SFT source's passes are its own setting.
EPOCHS = "data.sources.<name>.max_epochs={value}; passes over an SFT source; trainer.max_steps ends the run too"
FOREIGN_NAMES: dict[str, str] = {
    # the optimizer and its schedule
    "learning_rate": "optim.lr={value}",
    "lr": "optim.lr={value}",
    "weight_decay": "optim.weight_decay={value}",
    "warmup_steps": "scheduler.warmup_steps={value}",
    "num_warmup_steps": "scheduler.warmup_steps={value}",
    "warmup_ratio": "scheduler.warmup_steps=<warmup_ratio x trainer.max_steps>; a count of optimizer steps",
    "lr_scheduler_type": "scheduler=cosine, scheduler=linear or scheduler=constant (a config group)",
    "lr_warmup_steps": "scheduler.warmup_steps={value}",
    "max_grad_norm": "train.max_grad_norm={value}",
    "clip_grad_norm": "train.max_grad_norm={value}",
    "gradient_clip_val": "train.max_grad_norm={value}",
    # batches and lengths
    "per_device_train_batch_size": "train.micro_batch_size={value}; rows per forward pass and device",
    "batch_size": "train.micro_batch_size={value}; rows per forward pass and device",
    "micro_batch_size": "train.micro_batch_size={value}",
    "global_batch_size": "train.global_batch_size={value}",
    "gradient_accumulation_steps": (
        "train.global_batch_size=<train.micro_batch_size x {value} x data-parallel devices>"
        "; plait derives the accumulation steps from the global batch"
    ),
    "max_seq_length": "data.seq_len={value}",
    "max_length": "data.seq_len={value}",
    "max_seq_len": "data.seq_len={value}",
    "seq_len": "data.seq_len={value}",
    # how long and how often
    "max_steps": "trainer.max_steps={value}",
    "max_iters": "trainer.max_steps={value}",
    "num_train_epochs": EPOCHS,
    "epochs": EPOCHS,
    "max_epochs": EPOCHS,
    "eval_steps": "train.eval_every={value}",
    "eval_interval": "train.eval_every={value}",
    "logging_steps": "trainer.log_every_n_steps={value}",
    "save_steps": "callbacks.checkpoint.every_n_steps={value}",
    "save_interval": "callbacks.checkpoint.every_n_steps={value}",
    "save_total_limit": "callbacks.checkpoint.keep_last={value}",
    # LoRA (any of its fields turns it on)
    "lora_r": "strategy.lora.rank={value}",
    "lora_rank": "strategy.lora.rank={value}",
    "r": "strategy.lora.rank={value}",
    "lora_alpha": "strategy.lora.alpha={value}",
    "alpha": "strategy.lora.alpha={value}",
    "lora_dropout": "strategy.lora.dropout={value}",
    "lora_target_modules": "strategy.lora.target_modules={value}",
    "target_modules": "strategy.lora.target_modules={value}",
    # the objective, precision, seed
    "beta": "objective.beta={value}",
    "bf16": "trainer.precision=bf16-mixed",
    "fp16": "trainer.precision=bf16-mixed (plait's mixed precision; 16-true keeps the weights in float16)",
    "precision": "trainer.precision={value}; 32-true, bf16-mixed, bf16-true or 16-true",
    "dtype": "trainer.precision=bf16-mixed (or 32-true)",
    "seed": "seed={value}",
    # where the model comes from and the run goes
    "model_name_or_path": "model=hf model.init_from={value}; a local Hugging Face directory",
    "checkpoint_dir": "model=hf model.init_from={value}; a local Hugging Face directory",
    "output_dir": "run_dir={value}",
    "out_dir": "run_dir={value}",
    "report_to": "logger={value}; csv, tensorboard or wandb; each writes metrics.csv",
    **{f"strategy.{old}": f"strategy.{new}={{value}}; moved into its plugin's node" for old, new in MOVED_KEYS.items()},
}


def plait_override(key: str, value: str, *, by_last_part: bool = True) -> str | None:
    """The plait override that a foreign option ``key=value`` means (`FOREIGN_NAMES`: the whole key,
    then its last part unless ``by_last_part`` is false); None when the key is not a known foreign
    name, or names itself.

    Callers try the whole key first, then the closest key of plait's own node (``model.max_seq_length``
    means ``model.max_seq_len`` there, not LitGPT's ``data.seq_len``), then the last part."""
    key = key.lstrip("+~")
    row = FOREIGN_NAMES.get(key)
    if row is None and by_last_part:
        row = FOREIGN_NAMES.get(key.rpartition(".")[2])
    if row is None or row.partition("=")[0] == key:
        return None
    return row.replace("{value}", value)
