"""PAFT's L1 on the fine-tuning delta: the proximal soft-threshold toward the base."""

import torch

from trainer.callbacks.delta_l1 import soft_threshold_
from trainer.merge import sparsity


def test_soft_threshold_shrinks_the_delta_and_zeroes_small_entries():
    base = torch.tensor([1.0, 1.0, 1.0, 1.0])
    param = base + torch.tensor([0.5, -0.05, 0.02, -1.0])
    soft_threshold_(param, base, 0.1)
    torch.testing.assert_close(param - base, torch.tensor([0.4, 0.0, 0.0, -0.9]), rtol=0, atol=1e-6)
    assert sparsity({"p": base}, {"p": param})["zero"] == 0.5


def test_repeated_steps_raise_delta_sparsity_over_plain_updates():
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(1000)
    plain, l1 = base.clone(), base.clone()
    for _ in range(20):  # noisy small updates, as from an optimizer
        step = 1e-3 * torch.randn(1000, generator=g)
        plain += step
        l1 += step
        soft_threshold_(l1, base, 5e-4)
    assert sparsity({"p": base}, {"p": plain})["zero"] == 0.0
    assert sparsity({"p": base}, {"p": l1})["zero"] > 0.2  # 0.29 with this seed
