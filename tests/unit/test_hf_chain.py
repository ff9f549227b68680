"""A run started from a Hugging Face model is the next stage's ``model.init_from`` without an export:
its architecture stays in the Hugging Face directory (``model.config_from``, `trainer.init_from.take_run_model`),
its weights come from the run, and the next stage fine-tunes at the Hugging Face rate."""

from __future__ import annotations

import os

import torch
from hf_checkpoints import make_hf_dir
from hydra.utils import instantiate

from strategies.runtime.launch import LAUNCH_ENV
from trainer.build import build_run
from trainer.compose import compose
from trainer.config import validate
from trainer.init_from import load_init_from
from trainer.model_node import constructor_node
from trainer.resume_record import ResumeRecord
from trainer.run_model import load_run_model


def test_dpo_starts_from_an_sft_run_of_a_hub_model(tmp_path) -> None:
    hub, sft = tmp_path / "hub", tmp_path / "sft"
    make_hf_dir("llama3", hub)
    cfg = compose(
        "sft",
        ["model=hf", f"model.init_from={hub}", "data=synthetic", "trainer.max_steps=1", "train.eval_every=0",
         "optim.lr=1e-2", f"run_dir={sft}"],
    )  # fmt: skip
    trainer, task, data = build_run(cfg, sft, launcher="fork")
    trainer.callbacks.append(ResumeRecord(cfg, data.tokenizer, sft, {}))
    try:
        trainer.fit(task, datamodule=data)
    finally:
        for key in LAUNCH_ENV:  # the next fit in this process must not look "launched externally"
            os.environ.pop(key, None)

    dpo = compose("dpo", [f"model.init_from={sft}", "data=preference_synthetic"])
    assert dpo.model.config_from == str(hub)
    assert dpo.model.init_from == str(sft)
    assert dpo.optim.lr == 1e-6  # the Hugging Face rate: the chain started from a hub model
    validate(dpo)
    model = instantiate(constructor_node(dpo.model), vocab_size=data.tokenizer.vocab_size)
    load_init_from(model, dpo.model.init_from)
    trained = load_run_model(sft).model.state_dict()
    hub_weights = load_run_model(hub).model.state_dict()
    state = model.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in state)  # the sft run's weights, not the hub's
    assert any(not torch.equal(state[k], hub_weights[k]) for k in state)


def test_a_moved_architecture_folder_is_named_with_the_fix(tmp_path) -> None:
    from omegaconf import OmegaConf

    from trainer.init_from import init_from_problems
    from trainer.run_model import HF_BUILDER

    model = OmegaConf.create({"_target_": HF_BUILDER, "init_from": "runs/sft", "config_from": str(tmp_path / "gone")})
    assert init_from_problems(model) == [
        f"model.config_from={tmp_path / 'gone'} (the Hugging Face directory the run model.init_from=runs/sft started "
        "from) has no config.json; if it moved, name it: +model.config_from=<its new directory>"
    ]


def test_model_hf_from_a_plait_run_says_to_drop_model_hf(tmp_path) -> None:
    """``model=hf model.init_from=<plait run>`` said only that model=hf needs a Hugging Face directory; a
    plait run (a Hugging Face model's included) continues without model=hf (a reviewer).
    Mutation: the plait-run branch off -> the message lacks the fix."""
    from omegaconf import OmegaConf

    from strategies.checkpoint.manifest import checkpoint_files, hash_files, write_manifest
    from trainer.init_from import init_from_problems
    from trainer.run_model import HF_BUILDER

    ckpt = tmp_path / "run" / "checkpoints" / "step_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"weights")
    (ckpt / "meta.pt").write_bytes(b"")
    write_manifest(ckpt, hash_files(ckpt, checkpoint_files(ckpt)))
    (problem,) = init_from_problems(OmegaConf.create({"_target_": HF_BUILDER, "init_from": str(tmp_path / "run")}))
    assert f"has no config.json (it is a plait run: drop model=hf, and model.init_from={tmp_path / 'run'}" in problem
    (gone,) = init_from_problems(OmegaConf.create({"_target_": HF_BUILDER, "init_from": str(tmp_path / "gone")}))
    assert "does not exist; model=hf needs a Hugging Face model directory" in gone
