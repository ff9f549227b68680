"""Parallelism degrees of one run and the N-D device mesh they describe.

`ParallelDims` is checked before any process group exists, so a bad layout costs nothing: every
problem is reported at once, each with the override that fixes it (STYLE rule 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Outermost to innermost. Inner axes hold the ranks that talk most (TP, then CP), so on a real
# cluster they land inside one node when ranks are numbered node by node.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message lists every problem and its fix."""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the five parallelisms; ``-1`` (at most one) fills what is left of the world.

    Args:
        dp_replicate: data-parallel replicas (DDP, or the replica axis of HSDP).
        dp_shard: FSDP shard degree.
        cp: context-parallel degree (sequence split across ranks).
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree (stages).

    Raises:
        LayoutError: from `resolve` when the degrees cannot form a mesh of the given world size.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1

    def resolve(self, world_size: int) -> "ParallelDims":
        """Returns the degrees with ``-1`` filled in for ``world_size`` ranks.

        Raises:
            LayoutError: listing every problem (bad values, several -1, product != world size).
        """
        degrees = {f.name: getattr(self, f.name) for f in fields(self)}
        problems = [
            f"strategy.{name}={value} is not allowed; use a positive degree or -1 (fill from the world size)"
            for name, value in degrees.items()
            if value == 0 or value < -1
        ]
        fill = [name for name, value in degrees.items() if value == -1]
        if len(fill) > 1:
            problems.append(
                f"only one degree may be -1, got {', '.join(fill)}; set all but one of them, e.g. "
                f"strategy.{fill[1]}=1"
            )
        if problems:
            raise LayoutError("\n".join(problems))
        known = math.prod(v for v in degrees.values() if v != -1)
        if fill:
            if world_size % known:
                raise LayoutError(
                    f"the fixed degrees multiply to {known}, which does not divide the world size {world_size}; "
                    f"use trainer.devices (x trainer.num_nodes) = a multiple of {known}"
                )
            degrees[fill[0]] = world_size // known
        elif known != world_size:
            raise LayoutError(
                f"the degrees {_fmt(degrees)} multiply to {known} but the world size is {world_size}; "
                f"set trainer.devices (x trainer.num_nodes) to {known} or set one degree to -1"
            )
        return ParallelDims(**degrees)

    def check_model(
        self,
        *,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        seq_len: int,
        vocab_size: int | None = None,
        ffn_dim: int | None = None,
    ) -> list[str]:
        """Problems (as messages naming the fix) of these degrees for a model and sequence length.

        Call on resolved degrees. Returns an empty list when the layout fits. ``vocab_size`` and
        ``ffn_dim`` are checked against tp when known (None: checked when the model is built).
        """
        from strategies.tensor import tp_divisibility_problems  # tensor.py imports this module

        problems = tp_divisibility_problems(
            self.tp, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab_size, ffn_dim=ffn_dim
        )
        if self.pp > n_layers:
            problems.append(f"strategy.pp={self.pp} exceeds the {n_layers} layers; use strategy.pp<={n_layers}")
        if self.cp > 1 and seq_len % (2 * self.cp):
            problems.append(
                f"data.seq_len={seq_len} is not divisible by 2*cp={2 * self.cp} (load-balanced ring attention); "
                f"use a seq_len that is a multiple of {2 * self.cp}"
            )
        return problems

    @property
    def dp(self) -> int:
        """Data-parallel degree: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def build_mesh(self, device_type: str) -> tuple["DeviceMesh", dict[str, "DeviceMesh"]]:
        """Builds the named N-D mesh over the default process group, and its flattened views.

        Views: ``dp`` (dp_replicate x dp_shard: batch slicing, gradient sums), ``dp_cp``
        (dp x cp: the ranks whose supervised tokens are counted together for the loss) and, when
        cp > 1, ``dp_shard_cp`` (the ranks FSDP shards parameters over).
        ``DeviceMesh._flatten`` is private but is what torchtitan uses; torch keeps no public
        equivalent in 2.13, and the returned views are kept rather than sliced from the root again
        (slicing flattened axes from the root is deprecated).
        """
        from torch.distributed.device_mesh import init_device_mesh

        sizes = tuple(getattr(self, axis) for axis in MESH_AXES)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_AXES)
        views = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        if self.cp > 1:  # FSDP's mesh under context parallelism (cp ranks hold the same parameters)
            views["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh, views


def _fmt(degrees: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in degrees.items())
