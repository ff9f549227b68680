"""Matplotlib for plait's PNG files (``loss.png``, ``msft.png``, ``plait compare``'s plot)."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, never a window), imported on first use."""
    import matplotlib  # lazy: matplotlib takes ~0.5 s to import and only the plots need it

    matplotlib.use("Agg")  # before pyplot is imported: no display backend is ever tried
    import matplotlib.pyplot as plt  # lazy: as above, after the backend is chosen

    return plt
