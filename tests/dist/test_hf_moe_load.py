"""A Qwen3-MoE checkpoint made by ``transformers`` loads into expert-parallel ranks and exports back.

The tiny random Qwen3-MoE of tests/hf_checkpoints.py (4 experts, top-2, the first block dense) is
trained for 2 SGD-with-momentum steps from ``model=hf``: on one process and under expert
parallelism (2 ranks, ep=2: each rank reads only the two experts it holds from the safetensors
file). Losses and the parameters after the steps match (1e-6); the expert-parallel run's
``hf_export`` callback writes a directory whose tensors are the one-process parameters.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from harness import compose_config, fit, losses
from hf_checkpoints import make_hf_dir

TOL = {"rtol": 1e-6, "atol": 1e-6}
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_moe")
    make_hf_dir("qwen3_moe", root / "hf", max_position_embeddings=64)
    rng = random.Random(0)
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))})
                                               for _ in range(400)) + "\n")
    common = [
        "model=hf", f"model.init_from={root / 'hf'}", f"data.path={root / 'docs.jsonl'}", "optim=sgd",
        "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=0", "trainer.max_steps=2",
        "+callbacks.params._target_=harness.ParamRecorder",
    ]  # fmt: skip
    out = {}
    for name, layout in {"one": ["train.micro_batch_size=8"],
                         "ep2": ["strategy=nd", "trainer.devices=2", "strategy.expert_parallel.ep=2",
                                 "callbacks.hf_export.at_end=true"]}.items():
        run_dir = tmp_path_factory.mktemp(name)
        _, task = fit(compose_config([*common, *layout]), run_dir)
        out[name] = {"loss": losses(task.history), "params": [h["params"] for h in task.history if "params" in h][0],
                     "run_dir": run_dir}
    return out


def test_expert_parallel_load_trains_like_one_process_and_exports(runs):
    from safetensors.torch import load_file

    one, ep = runs["one"], runs["ep2"]
    torch.testing.assert_close(ep["loss"], one["loss"], **TOL, msg="losses (the first: the loaded weights)")
    torch.testing.assert_close(ep["params"], one["params"], **TOL)
    exported = {k: v for f in (ep["run_dir"] / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    for j in range(4):
        expert = exported[f"model.layers.1.mlp.experts.{j}.gate_proj.weight"]
        torch.testing.assert_close(expert, one["params"]["layers.1.feed_forward.experts.w1"][j], **TOL)
    assert json.loads((ep["run_dir"] / "hf" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
