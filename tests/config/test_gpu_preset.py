"""`trainer=gpu` resolves to the GPU settings, without a GPU; the CPU defaults stay as they were."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate

from trainer.compose import bundled_recipes, compose
from trainer.objectives.pretrain import CausalLM

# (key, CPU default, trainer=gpu)
SETTINGS = [
    ("trainer.accelerator", "auto", "gpu"),
    ("trainer.precision", "32-true", "bf16-mixed"),
    ("strategy.fsdp.param_dtype", None, "bf16"),  # FSDP2 MixedPrecisionPolicy when dp > 1
    ("strategy.fsdp.reduce_dtype", None, "fp32"),
    ("strategy.compile.enabled", False, True),
    ("optim.fused", True, True),
    ("objective.loss_chunk_tokens", None, None),  # None: chunked on CUDA, whole logits on CPU
]


def _get(cfg, key: str):  # noqa: ANN001, ANN202
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gpu_preset_and_cpu_defaults(strategy: str) -> None:
    cpu = compose("pretrain", [f"strategy={strategy}"])
    gpu = compose("pretrain", [f"strategy={strategy}", "trainer=gpu", "trainer.devices=4"])
    for key, on_cpu, on_gpu in SETTINGS:
        assert (_get(cpu, key), _get(gpu, key)) == (on_cpu, on_gpu), key
    # The recipe's own trainer settings survive the preset; the rest of the trainer node is the default's.
    assert gpu.trainer.max_steps == cpu.trainer.max_steps and gpu.trainer.devices == 4
    assert set(gpu.trainer) == set(cpu.trainer)


@pytest.mark.parametrize("recipe", sorted(set(bundled_recipes()) - {"preference"}))
def test_gpu_preset_composes_with_every_recipe(recipe: str) -> None:
    cfg = compose(recipe, ["trainer=gpu"])
    assert cfg.trainer.precision == "bf16-mixed" and cfg.strategy.compile.enabled


def test_automatic_loss_chunks_by_device() -> None:
    objective = instantiate(compose("pretrain").objective)
    head = SimpleNamespace(output=torch.nn.Linear(4, 8, bias=False))
    cuda_batch = {"input_ids": SimpleNamespace(is_cuda=True)}
    assert objective.chunk_tokens(head, {"input_ids": torch.zeros(1, 2, dtype=torch.long)}) == 0
    assert objective.chunk_tokens(head, cuda_batch) == CausalLM.CUDA_CHUNK_TOKENS
    assert objective.chunk_tokens(SimpleNamespace(output=torch.zeros(1)), cuda_batch) == 0  # a pipeline replay
    assert CausalLM(loss_chunk_tokens=0).chunk_tokens(head, cuda_batch) == 0


@pytest.mark.parametrize("optim", ["adamw", "sgd", "muon"])
def test_the_gpu_preset_builds_every_optimizer(optim: str) -> None:
    """The preset sets no optimizer key: AdamW's ``fused`` given to Muon failed its build at validate."""
    from strategies.core.ranges import optimizer_problem

    cfg = compose("pretrain", [f"optim={optim}", "trainer=gpu"])
    assert optimizer_problem(instantiate(cfg.optim, _convert_="all")) is None
