"""Step values kept on the device until a step that reads them: no host sync on the others.

Reading a device value on the host (``.item()``, ``.tolist()``, a tensor in an ``if``) waits for
every kernel queued before it. Done every step, it stops the host from queuing step k+1 while the
accelerator still runs step k, and the accelerator idles for the host's gap between steps
(torchtitan reads its loss only on logging steps for this reason). `PendingSteps` holds each
step's 0-dim device values (loss, gradient norm, router balance, ...) and named per-source means,
and converts all of them with one transfer when the Task reads them (logging and evaluation steps,
checkpoints, the end of the fit). On a CPU the values are ready anyway: nothing changes but when
they are converted, and the floats are the same (each converted from float32 as before).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Value = float | int | torch.Tensor


@dataclass
class NamedMeans:
    """Per-name means of one step (e.g. the loss of each SFT source): ``{prefix}/<name>`` =
    ``mean[i]``, left out where ``count[i]`` is 0.

    Attributes:
        prefix: "train" or "val".
        names: n names.
        mean_count: [2, n] float32: the means (sum / count, on the device) and the counts.
    """

    prefix: str
    names: list[str]
    mean_count: torch.Tensor

    @classmethod
    def of_sums(cls, prefix: str, names: list[str], sums: torch.Tensor) -> NamedMeans:
        """From [2, n] (sum, count) rows, dividing on the device in float32."""
        sums = sums.float()
        return cls(prefix, list(names), torch.stack([sums[0] / sums[1], sums[1]]))

    def values(self, flat: list[float]) -> dict[str, float]:
        """The metrics, from this object's ``2 n`` converted values (means, then counts)."""
        n = len(self.names)
        return {f"{self.prefix}/{name}": flat[i] for i, name in enumerate(self.names) if flat[n + i] > 0}


@dataclass
class _Step:
    values: dict[str, Value]  # in the order given; tensors detached, on the device
    means: list[NamedMeans] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in self.values.values() if isinstance(v, torch.Tensor)] + [m.mean_count for m in self.means]


class PendingSteps:
    """Steps whose device values are not read yet, oldest first."""

    def __init__(self) -> None:
        self._steps: list[_Step] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, values: dict[str, Value], means: list[NamedMeans] = ()) -> None:
        """One step's entry: host numbers as they are, tensors (0-dim) kept on the device."""
        kept = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        self._steps.append(_Step(kept, list(means)))

    def read(self) -> list[dict[str, float]]:
        """Every pending step as a dict of floats (keys in the order added), in one device-to-host
        transfer; the pending list is then empty."""
        steps, self._steps = self._steps, []
        # float64 holds every float32 value and every integer count below 2^53 exactly.
        parts = [t.double().reshape(-1) for step in steps for t in step.tensors()]
        flat = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []  # the one transfer
        out, at = [], 0
        for step in steps:
            entry: dict[str, float] = {}
            for key, value in step.values.items():
                if isinstance(value, torch.Tensor):
                    entry[key] = flat[at] if value.is_floating_point() else int(flat[at])
                    at += 1
                else:
                    entry[key] = value
            for means in step.means:
                size = means.mean_count.numel()
                entry.update(means.values(flat[at : at + size]))
                at += size
            out.append(entry)
        return out


def read_means(means: list[NamedMeans]) -> dict[str, float]:
    """The metrics of ``means`` now (one transfer)."""
    pending = PendingSteps()
    pending.add({}, means)
    return pending.read()[0]
