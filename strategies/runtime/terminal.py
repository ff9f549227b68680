"""Lines for the user on stderr that start a line of their own, also while a progress bar is drawn.

Lightning's progress bar is tqdm: its line ends in a carriage return, not a newline, so a plain
print ran on after the bar (``...it/s]plait: error: ...``), where a reader, or ``grep '^plait'``,
missed it. `write_line` goes through ``tqdm.write`` on a terminal (the bar is cleared and drawn
again after) and starts a fresh line in a log file. Nothing imports tqdm for it: without a bar
(every command but training) it is a plain print.
"""

from __future__ import annotations

import sys


def write_line(text: str) -> None:
    """Writes ``text`` and a newline on stderr, at the start of a line (see the module docstring)."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    if tqdm is None or not getattr(tqdm, "_instances", None):
        print(text, file=sys.stderr, flush=True)
    elif not sys.stderr.isatty():  # a log file: the bar's line has no newline of its own
        print(f"\n{text}", file=sys.stderr, flush=True)
    else:
        tqdm.write(text, file=sys.stderr)
        sys.stderr.flush()
