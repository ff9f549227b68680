"""glibc's accounting of one step's large host tensors (tests/unit/test_host_allocator.py), in a module
that imports torch alone, so that a fresh interpreter probes it in a second."""

from __future__ import annotations

import ctypes

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def probe() -> dict[str, float]:
    """MiB mmapped for one 64 MiB tensor (one step's fp32 logits at 2,048 tokens and V = 8,192),
    and MiB free at the heap's top after a 128 MiB block is freed (straight from malloc, and larger
    than any free chunk, so it is cut from the top and nothing allocated after it keeps it from there)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype, libc.malloc.restype, libc.malloc.argtypes = _MallInfo2, ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2()
    logits = torch.ones(2048, 8192)
    mapped = libc.mallinfo2().hblkhd - before.hblkhd
    del logits
    libc.free(libc.malloc(2**27))
    return {"mapped_mib": mapped / 2**20, "kept_mib": libc.mallinfo2().keepcost / 2**20}
