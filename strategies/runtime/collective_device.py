"""The device a collective's tensors must be on: the process group's backend decides, not the tensor.

FSDP's CPU offload (``strategy.fsdp.cpu_offload=true``) keeps parameters, gradients and optimizer
state on the host, while the process group of a GPU run is NCCL-only (``"cuda:nccl"``: Lightning's
default backend on GPUs): a collective on those host tensors fails. Plait's own collectives on
such tensors (the gradient norm's reductions, local SGD's averages) move them to
`collective_device` first and back after. gloo groups (``"cpu:gloo,cuda:gloo"``) and mixed
ones (``"cpu:gloo,cuda:nccl"``) take the tensor where it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_devices(group: dist.ProcessGroup | None = None) -> list[str]:
    """Device types ``group``'s backends serve (``dist.get_backend_config``: ``"cpu:gloo,cuda:nccl"``)."""
    config = dist.get_backend_config(group)
    if ":" not in config:  # a single backend name (custom backends): gloo-like on the host
        return ["cuda"] if config == "nccl" else ["cpu"]
    return [entry.split(":")[0] for entry in config.split(",")]


def collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """``device`` when ``group`` can run collectives on it, else the device its backend serves
    (the current CUDA device for an NCCL-only group); ``device`` without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return device
    served = backend_devices(group)
    if device.type in served:
        return device
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(served[0])
