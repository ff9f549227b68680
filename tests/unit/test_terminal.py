"""Lines for the user start a line of their own while the progress bar is drawn
(`strategies.runtime.terminal.write_line`): the divergence error, the Ctrl-C message, a plugin's
lines and LoRA's byte counts ran on after the bar's carriage return, where ``grep '^plait'`` missed them."""

from __future__ import annotations

import pytest
from tqdm import tqdm

from strategies.runtime.terminal import write_line
from trainer.catalog import fail


def test_a_line_after_a_drawn_bar_starts_a_line_of_its_own(capsys) -> None:
    """Mutation: a plain print (what fail and the run's errors did) leaves the line glued to the bar."""
    import sys

    bar = tqdm(total=3, file=sys.stderr)
    bar.update(1)
    try:
        write_line("plait: error: the run diverged")
        with pytest.raises(SystemExit):
            fail("a bad override")
    finally:
        bar.close()
    err = capsys.readouterr().err
    assert "\nplait: error: the run diverged\n" in err and "\nplait: error: a bad override\n" in err
    assert any(line.startswith("plait: error: the run diverged") for line in err.splitlines())


def test_without_a_bar_it_is_a_plain_line(capsys) -> None:
    write_line("plait: hello")
    assert capsys.readouterr().err == "plait: hello\n"
