"""Parallelism degrees of one run, the N-D device mesh they describe, and the mesh as plugins see it.

`ParallelDims` holds degrees and builds the mesh, nothing else: each technique checks its own
sizes (``problems`` of its plugin). Resolving the degrees needs no process group, so a bad layout
costs nothing: every problem is reported at once, each with the override that fixes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import init_device_mesh

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
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
                f"only one degree may be -1, got {', '.join(fill)}; set all but one of them, e.g. strategy.{fill[1]}=1"
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
        return replace(self, **degrees)

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
        sizes = tuple(getattr(self, axis) for axis in MESH_AXES)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_AXES)
        views = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        if self.cp > 1:  # FSDP's mesh under context parallelism (cp ranks hold the same parameters)
            views["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh, views


@dataclass(frozen=True)
class Meshes:
    """The run's device mesh as the plugins see it (the second argument of every plugin's ``apply``).

    Args:
        root: the named (pp, dp_replicate, dp_shard, cp, tp) mesh.
        views: flattened views of it (`ParallelDims.build_mesh`): "dp", "dp_cp" and, when cp > 1,
            "dp_shard_cp".
        fsdp: the mesh FSDP shards parameters over (chosen by the strategy: HSDP, cp, local SGD).
        device: this rank's device.
        plugins: the strategy's configured plugins by node key, for a plugin that takes another's
            settings (expert parallelism shards its experts with the ``fsdp`` plugin's policies).
    """

    root: "DeviceMesh"
    views: Mapping[str, "DeviceMesh"]
    fsdp: "DeviceMesh"
    device: "torch.device"
    plugins: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, axis: str) -> "DeviceMesh":
        """One mesh axis ("pp", "tp", ...) or flattened view ("dp", "dp_cp", "dp_shard_cp")."""
        return self.views[axis] if axis in self.views else self.root[axis]

    def group(self, axis: str) -> "dist.ProcessGroup":
        """The process group of one mesh axis or view."""
        return self[axis].get_group()

    def cp_ranks(self) -> list[list[int]]:
        """The global ranks of every cp group of the mesh, each in cp order (for sub-group creation)."""
        ranks = self.root.mesh.movedim(MESH_AXES.index("cp"), -1)
        return ranks.reshape(-1, ranks.shape[-1]).tolist()


def _fmt(degrees: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in degrees.items())
