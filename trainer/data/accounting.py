"""What data preparation leaves out of each source: counted, printed, logged, and refused when nothing is left.

A run that trains on cut data finishes and learns the wrong thing without a word: plait's DPO check
fell from 0.965 to 0.566 held-out reward accuracy when a preset's ``data.max_prompt_len`` cut the
part of every prompt that held the task. So every data module counts, per source and over its
training split, what preparation did to the samples (`SourceCounts`):

- ``dropped``: samples left out whole (unusable rows, ``data.long_samples=drop``);
- ``truncated``: samples kept with supervised tokens cut at the end (``data.seq_len``);
- ``prompts_cut``: samples whose prompt lost tokens (preference pairs: ``data.max_prompt_len``);
- ``supervised_tokens_lost`` / ``supervised_tokens``: the supervised tokens cut / kept;
- ``split``: samples longer than ``data.seq_len`` kept whole (``data.long_samples=split``): they
  continue in the next rows, each piece its own document (positions from 0, attention within the
  piece), and ``supervised_tokens_split`` counts their supervised tokens past the first
  ``data.seq_len``, which train without seeing their sample's start (at least these: the packer
  may start a long sample in a row's tail).

The run prints one line of the counts at launch (`report_lines`), warns once per source when more
than `WARN_FRACTION` of its samples, or of its supervised tokens, were cut, or were split (naming
the setting to change: one long sample can hold most of a source's tokens), logs them at step 0 (`metrics`: ``data/<count>/<source>``) and writes them to
``summary.json`` (`as_json`). The held-out split is counted the same way (its own launch line and
``held_out`` in ``summary.json``): its losses and scores are measured on what is left. A source
whose training or held-out samples keep no supervised token is refused before any process starts
(`problems`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# More than this share of a source's samples, or of its supervised tokens, cut or split gets a warning line.
WARN_FRACTION = 0.05
COUNTS = (
    "samples", "dropped", "truncated", "prompts_cut", "supervised_tokens_lost", "supervised_tokens", "split",
    "supervised_tokens_split",
)  # fmt: skip


@dataclass
class SourceCounts:
    """Counts of one source's training samples (see module docstring).

    Args:
        fix: the settings that would keep what was cut, for the warning line
            (e.g. ``raise data.seq_len (the longest pair needs 71 tokens)``).
    """

    samples: int = 0
    dropped: int = 0
    truncated: int = 0
    prompts_cut: int = 0
    supervised_tokens_lost: int = 0
    supervised_tokens: int = 0
    split: int = 0
    supervised_tokens_split: int = 0
    affected: int = 0  # samples that lost supervised or prompt tokens, each counted once
    fix: str = field(default="", compare=False)

    def add(
        self,
        *,
        supervised_kept: int,
        supervised_lost: int = 0,
        prompt_lost: int = 0,
        dropped: bool = False,
        supervised_split: int | None = None,
    ) -> None:
        """Counts one sample: its supervised tokens kept and lost, its prompt tokens lost, whether
        it was left out whole (its supervised tokens are then all lost), and, for a sample split
        across rows, its supervised tokens past the first row's length (None: not split)."""
        self.samples += 1
        self.split += int(supervised_split is not None)
        self.supervised_tokens_split += supervised_split or 0
        self.dropped += int(dropped)
        self.truncated += int(supervised_lost > 0 and not dropped)
        self.prompts_cut += int(prompt_lost > 0 and not dropped)
        self.affected += int(dropped or supervised_lost > 0 or prompt_lost > 0)
        self.supervised_tokens += supervised_kept
        self.supervised_tokens_lost += supervised_lost


def seq_len_fix(lengths: list[int], seq_len: int, noun: str) -> str:
    """The ``data.seq_len`` advice of a source whose samples (of ``lengths`` tokens each) are cut:
    the length that keeps 95% of them whole, and the one that keeps all of them."""
    ordered = sorted(lengths)
    if not ordered:
        return f"raise data.seq_len (now {seq_len})"
    p95 = ordered[min(len(ordered) - 1, -(-95 * len(ordered) // 100) - 1)]
    most = f"{p95:,} keeps 95% of its {noun} whole, " if p95 < ordered[-1] else ""
    return f"raise data.seq_len (now {seq_len}; {most}{ordered[-1]:,} keeps all)"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "0%"


def _cuts(c: SourceCounts, noun: str) -> str:
    parts = [
        f"{c.dropped:,} dropped" if c.dropped else "",
        f"{c.truncated:,} truncated" if c.truncated else "",
        f"{c.prompts_cut:,} with the prompt cut" if c.prompts_cut else "",
        f"{c.split:,} split across rows" if c.split else "",
    ]
    cut = ", ".join(p for p in parts if p) or "nothing cut"
    lost = f"; {c.supervised_tokens_lost:,} supervised tokens lost" if c.supervised_tokens_lost else ""
    return f"{c.samples:,} {noun}: {cut}{lost}"


def report_lines(
    counts: dict[str, SourceCounts], noun: str = "samples", held_out: dict[str, SourceCounts] | None = None
) -> list[str]:
    """The launch lines: one ``data cuts: ...`` line when anything was cut (and one for the held-out
    split), and one ``warning:`` line per source whose training samples were cut or split above
    `WARN_FRACTION` of its samples or of its supervised tokens.

    Args:
        counts: source name -> the counts of its training samples.
        noun: what a sample is here (``pairs``, ``conversations``, ``labelled rows``).
        held_out: source name -> the counts of its held-out samples.
    """
    lines = []
    if any(c.affected or c.split for c in counts.values()):
        lines.append(
            "data cuts: "
            + "; ".join(f"data.sources.{name}: {_cuts(c, noun)}" for name, c in counts.items() if c.affected or c.split)
        )
    if held_out and any(c.affected or c.split for c in held_out.values()):
        cut = "; ".join(
            f"data.sources.{name}: {_cuts(c, noun)}" for name, c in held_out.items() if c.affected or c.split
        )
        lines.append(f"data cuts (held-out, scored as cut): {cut}")
    for name, c in counts.items():
        lost = c.supervised_tokens_lost / max(1, c.supervised_tokens + c.supervised_tokens_lost)
        if c.samples and (c.affected / c.samples > WARN_FRACTION or lost > WARN_FRACTION):
            total = c.supervised_tokens + c.supervised_tokens_lost
            tokens = (
                f": {c.supervised_tokens_lost:,} of {total:,} supervised tokens ({_pct(c.supervised_tokens_lost, total)}) cut"
                if c.supervised_tokens_lost
                else ""
            )
            lines.append(
                f"warning: data.sources.{name}: {c.affected:,} of {c.samples:,} training {noun} "
                f"({_pct(c.affected, c.samples)}) lose supervised or prompt tokens{tokens}; {c.fix}"
            )
        split = c.supervised_tokens_split / max(1, c.supervised_tokens)
        if c.samples and (c.split / c.samples > WARN_FRACTION or split > WARN_FRACTION):
            total = c.supervised_tokens
            lines.append(
                f"warning: data.sources.{name}: {c.split:,} of {c.samples:,} training {noun} "
                f"({_pct(c.split, c.samples)}) are longer than a row and continue in the next rows as separate "
                f"documents: at least {c.supervised_tokens_split:,} of {total:,} supervised tokens "
                f"({_pct(c.supervised_tokens_split, total)}) train without seeing their start; {c.fix}"
            )
    return lines


def problems(
    counts: dict[str, SourceCounts], noun: str = "samples", held_out: dict[str, SourceCounts] | None = None
) -> list[str]:
    """Sources whose training samples keep no supervised token at all (nothing to train on), and
    sources whose held-out samples keep none (nothing to score), each with its fix."""
    out = [
        f"data.sources.{name}: none of its {c.samples:,} training {noun} keeps a supervised token "
        f"({c.supervised_tokens_lost:,} cut); {c.fix}"
        for name, c in counts.items()
        if c.samples and c.supervised_tokens == 0
    ]
    return out + [
        f"data.sources.{name}: none of its {c.samples:,} held-out {noun} keeps a supervised token (nothing left to score "
        f"it on; {c.supervised_tokens_lost:,} cut); {c.fix}"
        for name, c in (held_out or {}).items()
        if c.samples and c.supervised_tokens == 0
    ]


def metrics(counts: dict[str, SourceCounts]) -> dict[str, float]:
    """``data/<count>/<source>`` of every count, for the loggers (row 0)."""
    return {f"data/{key}/{name}": float(getattr(c, key)) for name, c in counts.items() for key in COUNTS}


def as_json(
    counts: dict[str, SourceCounts], held_out: dict[str, SourceCounts] | None = None
) -> dict[str, dict[str, Any]]:
    """``{source: {count: value, ..., "held_out": {count: value}}}`` for ``summary.json``."""
    out: dict[str, dict[str, Any]] = {
        name: {k: v for k, v in asdict(c).items() if k in COUNTS} for name, c in counts.items()
    }
    for name, c in (held_out or {}).items():
        out.setdefault(name, {})["held_out"] = {k: v for k, v in asdict(c).items() if k in COUNTS}
    return out
