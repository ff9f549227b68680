"""Silences what third-party libraries print that a plait user cannot act on.

Lightning's start-up banners (``GPU available``, ``TPU available``, the ``litlogger`` advert,
``Initializing distributed``, ``All distributed processes registered``, ```Trainer.fit` stopped``)
are INFO records of its loggers: plait prints what it checked itself (the data summary, the
checkpoint resumed from, the run directory). The warnings filtered here come from inside the
libraries (a deprecated call in Lightning's own code, DCP's single-process load in
``plait generate``/``export``, ``torch.load``'s ``weights_only`` notice on files plait loads with
``weights_only=True``, the logging-interval guess for short epochs); every other warning, and every Lightning WARNING/ERROR record, still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

# (message regex, category) of the warnings a user cannot act on.
IGNORED_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r".*isinstance\(treespec, LeafSpec\)", Warning),  # lightning/pytorch/utilities/_pytree.py
    (r".*torch\.distributed is disabled, unavailable or uninitialized", UserWarning),  # DCP, one process
    (r".*weights_only", FutureWarning),
    (r".*`weights_only`", UserWarning),
    # Lightning's guess for an epoch shorter than trainer.log_every_n_steps: plait logs by global step,
    # across epochs, so nothing is missed (a small corpus printed it on every run).
    (r".*is smaller than the logging interval", UserWarning),
)
# The loggers of Lightning's INFO banners: its rank-zero helpers and the process-group set-up (child
# loggers: importing Lightning resets the level of ``lightning.pytorch`` itself to INFO).
QUIET_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.distributed",
)


# (logger, message regex) of log records printed on import that a user cannot act on: torchao's
# CUDA-only extensions and Triton kernels absent on a CPU machine, bitsandbytes' remote CPU kernel
# (plait downloads nothing), torch's notice about torchao's own enum registration.
QUIET_RECORDS = (
    ("torchao", r"Failed to load .*\.so"),
    ("torchao.kernel.intmm", r".*Detected no triton"),
    ("torch.utils._pytree", r".*is an Enum subclass"),
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward"),
)


class _Drop(logging.Filter):
    """Drops a logger's records whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_third_party() -> None:
    """Sets Lightning's loggers to WARNING, ignores `IGNORED_WARNINGS` and drops `QUIET_RECORDS`
    (in this process; child processes that plait starts run the CLI again, which calls this too)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, pattern in QUIET_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
    for message, category in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
