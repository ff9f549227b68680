"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), for `llama.Llama`."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias.

    Computed in float32 and cast back to the input dtype, by the fused ``F.rms_norm`` kernel (CPU
    and CUDA): one op and one saved tensor pair instead of the five elementwise ops of the formula.

    With ``unit_offset`` the scale is ``1 + weight`` (Gemma's checkpoints store the offset from 1,
    and its weights start at 0).

    Shapes: input ``[..., dim]`` -> output ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def scale(self) -> torch.Tensor:
        """The fp32 scale the normalised input is multiplied by."""
        return self.weight.float() + 1.0 if self.unit_offset else self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.scale(), self.eps).to(x.dtype)


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection's features, every head at once (OLMo 2's QK-norm).

    The formula written out (as transformers' ``Olmo2RMSNorm``), not the fused kernel: under tensor
    parallelism the features arrive sharded by head as a DTensor (``Shard(-1)``), and DTensor
    turns the mean of squares into one all-reduce of ``[..., 1]`` per call, where the fused
    kernel's sharding rule has no strategy for a sharded normalised dim.

    Shapes: input ``[B, T, heads * E]`` -> output ``[B, T, heads * E]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32, scale = x.float(), self.scale()
        if isinstance(x, DTensor) and isinstance(scale, DTensor):
            # This rank's slice of the replicated weight, taken explicitly: its gradient then comes
            # back replicated, as the weight is (DTensor's implicit slice leaves it sharded).
            scale = scale.redistribute(scale.device_mesh, [Shard(0)])
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (scale * normed).to(x.dtype)
