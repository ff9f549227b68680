"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), for `llama.Llama`."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias.

    Computed in float32 and cast back to the input dtype.

    Shapes: input ``[..., dim]`` -> output ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)
