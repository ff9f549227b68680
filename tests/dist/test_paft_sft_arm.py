"""PAFT's SFT arm (``plait paft``, `DeltaL1`) makes the fine-tuning delta sparse under FSDP 2.

Pentyala et al. 2024 ("PAFT: A Parallel Training Paradigm for Effective LLM Fine-Tuning") add
``strength x ||theta - theta_base||_1`` to the SFT arm; plait applies it as a proximal step after
every optimizer step (soft-thresholding the delta at lr x strength, on the FSDP shards). Nano
Llama, the synthetic SFT sources, 3 steps of SGD (lr 0.05, momentum 0.9) on 2 gloo ranks; the
delta is measured over the transformer blocks' parameters (the embedding rows of tokens the data
never uses keep a zero delta at any strength) with plait's `merge.sparsity`:

- strength 1e-2 (threshold 5e-4 per step): most entries exactly 0 (measured 0.92);
- strength 0: no entry exactly 0 but those whose update rounds away in fp32 (measured 1e-5).
"""

from __future__ import annotations

import pytest
from harness import compose_config, fit
from matrix import _COMMON, _METRIC_LOSS, _SFT_DATA

from trainer.merge import sparsity

RUN = (
    *_COMMON, *_SFT_DATA, *_METRIC_LOSS, "optim.lr=0.05", "trainer.max_steps=3", "strategy=fsdp", "trainer.devices=2",
    "+callbacks.initial_params._target_=harness.InitialParamRecorder", "+callbacks.params._target_=harness.ParamRecorder",
)


def block_delta_sparsity(strength: float, tmp_path) -> float:  # noqa: ANN001
    _, task = fit(compose_config([*RUN, f"callbacks.delta_l1.strength={strength}"], recipe="paft", tiny=False), tmp_path)
    base = next(h["initial_params"] for h in task.history if "initial_params" in h)
    final = next(h["params"] for h in task.history if "params" in h)
    blocks = [name for name in base if name.startswith("layers.")]
    return sparsity({n: base[n] for n in blocks}, {n: final[n] for n in blocks})["zero"]


@pytest.mark.parametrize(("strength", "low", "high"), [(1e-2, 0.5, 1.0), (0.0, 0.0, 1e-4)], ids=["l1", "off"])
def test_delta_l1_strength_sets_the_sparsity_of_the_delta(strength: float, low: float, high: float, tmp_path) -> None:  # noqa: ANN001
    assert low <= block_delta_sparsity(strength, tmp_path) <= high
