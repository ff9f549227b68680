"""Host memory for training on CPU: glibc's malloc keeps freed large blocks for the next step.

glibc serves an allocation above ``M_MMAP_THRESHOLD`` (128 KiB at start, raised as the process
frees such blocks, up to 32 MiB on 64-bit) with a fresh ``mmap`` and unmaps it at ``free``, and it
gives free memory at the top of the heap above ``M_TRIM_THRESHOLD`` back to the kernel. A training
step allocates and frees the same large tensors every step (the ``[B*T, V]`` fp32 logits, their
log-softmax and its gradient: 64 MiB each at 2,048 tokens and V = 8,192), so on CPU every step
pays the kernel's page faults and zero-filling of each again. PyTorch's Performance Tuning Guide
("Switch memory allocator") advises an allocator that keeps memory (jemalloc or tcmalloc through
``LD_PRELOAD``). `keep_freed_host_memory` gets that behaviour from glibc itself through
``mallopt(3)``: nothing to install or preload, and it can be set after the process has started.

What it gains on the CPU peer workload is in docs/benchmarks.md ("Host memory on CPU").

The cost: a process keeps its peak heap, so its resident memory does not fall after a large step.
"""

from __future__ import annotations

import ctypes
import os
from typing import Literal

M_TRIM_THRESHOLD = -1  # mallopt(3) parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2**31 - 1  # the largest value mallopt's int argument holds (2 GiB)

# strategy.cpu_allocator: keep_freed calls `keep_freed_host_memory` on CPU; system leaves glibc as it is.
CPUAllocator = Literal["keep_freed", "system"]


def is_glibc() -> bool:
    """Whether this process runs on GNU libc (asked of the C library itself, not of the executable)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or a C library without the name
        return False


def keep_freed_host_memory() -> bool:
    """Makes glibc serve blocks of up to 2 GiB from its heap and never trim the heap's top.

    Process-wide and permanent: later allocations of every thread follow it (blocks already
    mapped keep their mapping until freed). Call it once, before the training loop.

    Returns:
        True when glibc took both settings; False on a C library without ``mallopt`` (musl,
        macOS, Windows), whose allocator is then left as it is.
    """
    if not is_glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt  # glibc's, in this process
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)
    trimmed = mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    return bool(mapped and trimmed)
