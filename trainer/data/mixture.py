"""A deterministic, stateful mixture of SFT sources with per-source supervised-token budgets.

Each named source has

- ``weight``: its share of the *supervised tokens* while it is active. The next sample always
  comes from the active source furthest behind its share (smallest ``consumed / weight``; ties
  go to the earlier source), so the interleaving needs no random draw and its whole state is the
  per-source counters below;
- ``max_tokens``: its budget of supervised tokens, exact: the sample that would cross the budget
  is cut right after its last budgeted target, so the source contributes exactly ``max_tokens``
  (the targets cut off are counted as ``clipped``); None: no token budget;
- ``max_epochs``: how many passes over its samples it may make (fractional: ``floor(max_epochs x
  N)`` samples); None: unlimited (then ``max_tokens`` must be set).

Within an epoch a source visits its samples in a permutation seeded by (seed, source name,
epoch). The mixture state is, per source, ``epoch``, ``index`` (next position in the epoch's
permutation), ``emitted`` (samples drawn) and ``consumed`` / ``clipped`` (supervised tokens
drawn / cut by the budget). It is a dict of ints, saved in every checkpoint, so a resume in the
middle of an epoch continues exactly (case C07), and the mSFT controller can change budgets of a
restored mixture (a removed source gets ``max_tokens`` = its consumed tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.data.cache import digest
from trainer.data.packing import IGNORE_INDEX, Draw


@dataclass(frozen=True)
class SourceSpec:
    """Budget of one source (see module docstring). Raises ValueError on impossible values."""

    weight: float = 1.0
    max_tokens: int | None = None
    max_epochs: float | None = 1.0

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"weight={self.weight} must be >= 0")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 0")
        if self.max_epochs is not None and self.max_epochs < 0:
            raise ValueError(f"max_epochs={self.max_epochs} must be >= 0")
        if self.max_tokens is None and self.max_epochs is None:
            raise ValueError("max_tokens and max_epochs are both null: the source would never end; set one")


class SourceSamples:
    """The tokenized training samples of one source, stored flat.

    Args:
        ids, labels: per sample, equal-length int sequences (labels pre-shifted, -100 = no target).
    """

    def __init__(self, ids: list[np.ndarray] | list[list[int]], labels: list[np.ndarray] | list[list[int]]) -> None:
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.ids = np.concatenate([np.asarray(x, np.int64) for x in ids]) if len(ids) else np.empty(0, np.int64)
        self.labels = (
            np.concatenate([np.asarray(x, np.int64) for x in labels]) if len(labels) else np.empty(0, np.int64)
        )
        supervised = np.concatenate([[0], np.cumsum(self.labels != IGNORE_INDEX)])
        self.supervised = (supervised[self.offsets[1:]] - supervised[self.offsets[:-1]]).astype(np.int64)
        self._total = int(self.supervised.sum())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.labels[a:b]

    def total_supervised(self) -> int:
        return self._total


def _permutation(seed: int, name: str, epoch: int, n: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest(seed, name, epoch)[:8], "little"))).permutation(n)


class Mixture:
    """Draws samples from named sources under their budgets (see module docstring).

    Args:
        sources: name -> samples, in a fixed order (the order breaks ties and numbers the sources).
        specs: name -> budget.
        seed: seeds the per-epoch permutations.

    Raises:
        ValueError: names differ between ``sources`` and ``specs``.
    """

    def __init__(self, sources: dict[str, SourceSamples], specs: dict[str, SourceSpec], *, seed: int) -> None:
        if list(sources) != list(specs):
            raise ValueError(f"sources {list(sources)} and budgets {list(specs)} must name the same sources in order")
        self.names = list(sources)
        self.samples = [sources[n] for n in self.names]
        self.specs = [specs[n] for n in self.names]
        self.seed = seed
        self.state = {n: {"epoch": 0, "index": 0, "emitted": 0, "consumed": 0, "clipped": 0} for n in self.names}
        self._order_cache: dict[tuple[int, int], np.ndarray] = {}

    # ------------------------------------------------------------------------------ budgets
    def max_samples(self, s: int) -> float:
        spec = self.specs[s]
        if spec.max_epochs is None:
            return math.inf
        return math.floor(spec.max_epochs * len(self.samples[s]) + 1e-9)

    def exhausted(self, s: int) -> bool:
        """Whether source ``s`` can give no further sample."""
        spec, st = self.specs[s], self.state[self.names[s]]
        if spec.weight == 0 or len(self.samples[s]) == 0 or self.samples[s].total_supervised() == 0:
            return True
        if spec.max_tokens is not None and st["consumed"] >= spec.max_tokens:
            return True
        return st["emitted"] >= self.max_samples(s)

    def check_reachable(self) -> list[str]:
        """Problems with budgets that the epochs cannot reach (from the start of the mixture)."""
        problems = []
        for s, (name, spec) in enumerate(zip(self.names, self.specs)):
            if spec.max_tokens is None or spec.max_epochs is None:
                continue
            n = len(self.samples[s])
            full, rest = divmod(int(self.max_samples(s)), max(n, 1))
            reachable = full * self.samples[s].total_supervised() + (
                int(np.sort(self.samples[s].supervised)[::-1][:rest].sum()) if rest else 0
            )
            if reachable < spec.max_tokens:
                epochs = spec.max_tokens / max(self.samples[s].total_supervised(), 1)
                problems.append(
                    f"data.sources.{name}.max_tokens={spec.max_tokens} needs about {epochs:.2f} epochs of its "
                    f"{self.samples[s].total_supervised()} supervised tokens, more than max_epochs={spec.max_epochs}; "
                    f"raise data.sources.{name}.max_epochs (null: unlimited) or lower max_tokens"
                )
        return problems

    # ------------------------------------------------------------------------------ drawing
    def _order(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._order_cache:
            self._order_cache = {k: v for k, v in self._order_cache.items() if k[0] != s}
            self._order_cache[key] = _permutation(self.seed, self.names[s], epoch, len(self.samples[s]))
        return self._order_cache[key]

    def next_source(self) -> int | None:
        """The active source furthest behind its weight share; None when every source is exhausted."""
        best, best_key = None, None
        for s, name in enumerate(self.names):
            if self.exhausted(s):
                continue
            key = self.state[name]["consumed"] / self.specs[s].weight
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def draw(self) -> Draw | None:
        """The next sample, or None when the mixture is exhausted. Samples without a target are
        skipped (they would cost compute and train nothing)."""
        while (s := self.next_source()) is not None:
            st = self.state[self.names[s]]
            i = int(self._order(s, st["epoch"])[st["index"]])
            st["index"] += 1
            st["emitted"] += 1
            if st["index"] == len(self.samples[s]):
                st["epoch"], st["index"] = st["epoch"] + 1, 0
            ids, labels = self.samples[s].sample(i)
            supervised = int(self.samples[s].supervised[i])
            if supervised == 0:
                continue
            budget = self.specs[s].max_tokens
            if budget is not None and st["consumed"] + supervised > budget:
                keep = budget - st["consumed"]
                last = int(np.flatnonzero(labels != IGNORE_INDEX)[keep - 1])  # the keep-th target
                st["clipped"] += supervised - keep
                ids, labels, supervised = ids[: last + 1], labels[: last + 1], keep
            st["consumed"] += supervised
            return Draw(source=s, ids=ids, labels=labels, supervised=supervised)
        return None

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {name: dict(st) for name, st in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores counters of the sources named in ``state``; others start fresh."""
        for name in self.names:
            if name in state:
                self.state[name] = dict(state[name])

    def epochs_done(self, name: str) -> float:
        """Passes over the source so far (epoch + fraction of the current one)."""
        st, n = self.state[name], len(self.samples[self.names.index(name)])
        return st["emitted"] / n if n else 0.0
