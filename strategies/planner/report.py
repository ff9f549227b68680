"""Text output of the planner: the ranked table, the best layout's overrides, an OOM check message."""

from __future__ import annotations

from collections.abc import Sequence

from strategies.planner.layout import Layout
from strategies.planner.memory import GiB, MemoryBreakdown
from strategies.planner.search import Plan
from strategies.planner.time import Cluster


def _ac(plan: Plan) -> str:
    lay = plan.layout
    text = {"none": "-", "full": "full"}.get(lay.ac, f"every {lay.ac_every_k}")
    return text + (" +offload" if lay.activation_offload else "")


def table(plans: Sequence[Plan], cluster: Cluster, *, top: int = 10) -> str:
    """The ``top`` fitting plans (ranked) as a fixed-width table, with a count of those dropped."""
    fitting = [p for p in plans if p.fits]
    header = f"{'#':>3}  {'layout':<34} {'mb':>3} {'AC':<10} {'mem GiB':>8} {'step s':>9} {'tok/s/dev':>10}"
    lines = [header, "-" * len(header)]
    for i, p in enumerate(fitting[:top], 1):
        lines.append(
            f"{i:>3}  {p.layout.label():<34} {p.layout.micro_batch_size:>3} {_ac(p):<10} "
            f"{p.memory.total / GiB:>8.2f} {p.time.total:>9.4g} {p.tokens_per_s:>10.4g}"
        )
    dropped = len(plans) - len(fitting)
    lines.append(
        f"{len(plans)} layouts on {cluster.name} ({cluster.world_size} devices); {dropped} dropped over the "
        f"memory cap of {cluster.memory_cap / GiB:.1f} GiB per device"
    )
    return "\n".join(lines)


def best_overrides(plans: Sequence[Plan], cluster: Cluster, configured: Layout | None = None) -> str:
    """``plait ... <overrides>`` of the fastest fitting plan (to add to the command line whose layout
    is ``configured``), or why there is none."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: p.memory.total, default=None)
        need = f" (the smallest needs {smallest.memory.total / GiB:.1f} GiB)" if smallest else ""
        return f"no layout fits in {cluster.memory_cap / GiB:.1f} GiB per device{need}; use more devices or a shorter data.seq_len"
    best = fitting[0]
    devices = [f"trainer.devices={cluster.devices_per_node}"] + (
        [f"trainer.num_nodes={cluster.num_nodes}"] if cluster.num_nodes > 1 else []
    )
    parts = [
        f"best: {best.layout.label()}, predicted {best.tokens_per_s:.4g} tokens/s per device, "
        f"{best.memory.total / GiB:.2f} GiB peak ({best.memory.describe()})",
        "time: " + ", ".join(f"{k} {v:.3g}s" for k, v in best.time.as_dict().items() if v),
        "overrides: " + " ".join(best.layout.overrides(against=configured) + devices),
    ]
    return "\n".join(parts)


def oom_message(memory: MemoryBreakdown, cluster: Cluster, label: str) -> str:
    """The planner.check error: predicted peak over the cap, with the breakdown and what to try."""
    return (
        f"planner.check: layout {label} is predicted to need {memory.total / GiB:.2f} GiB per device, over the "
        f"{cluster.memory_cap / GiB:.1f} GiB usable of cluster={cluster.name} ({memory.describe()}); "
        "try strategy.activation_checkpoint.mode=full, a smaller train.micro_batch_size, more sharding "
        "(strategy.dp_shard / tp / pp), or `plait plan` with the same overrides to rank the layouts that fit"
    )
