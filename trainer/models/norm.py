"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), for `llama.Llama`."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias.

    Computed in float32 and cast back to the input dtype, by the fused ``F.rms_norm`` kernel (CPU
    and CUDA): one op and one saved tensor pair instead of the five elementwise ops of the formula.

    Shapes: input ``[..., dim]`` -> output ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection's features, every head at once (OLMo 2's QK-norm).

    The formula written out (as transformers' ``Olmo2RMSNorm``), not the fused kernel: under tensor
    parallelism the features arrive sharded by head as a DTensor (``Shard(-1)``), and DTensor
    turns the mean of squares into one all-reduce of ``[..., 1]`` per call, where the fused
    kernel's sharding rule has no strategy for a sharded normalised dim.

    Shapes: input ``[B, T, heads * E]`` -> output ``[B, T, heads * E]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32, weight = x.float(), self.weight
        if isinstance(x, DTensor) and isinstance(weight, DTensor):
            # This rank's slice of the replicated weight, taken explicitly: its gradient then comes
            # back replicated, as the weight is (DTensor's implicit slice leaves it sharded).
            weight = weight.redistribute(weight.device_mesh, [Shard(0)])
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (weight.float() * normed).to(x.dtype)
