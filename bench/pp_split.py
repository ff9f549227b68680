"""Pipeline stages split by layer count vs by the planner's cost (``strategy.pipeline.split=auto``).

For a few models and pipeline layouts, the planner's predicted time of one micro-batch through
each stage (`strategies.planner.time.stage_costs`: embedding on the first stage, blocks, final
norm + output head + loss on the last) under the layer-count split and under the cost-balanced
split (`auto_split_points`), and the imbalance max/mean of the stage costs (1.0: perfectly even;
the slowest stage sets the pipeline's pace). No training: the model is read on the meta device.

Invocation (seconds)::

    python bench/pp_split.py

The last line is ``RESULT layers_max_over_mean=<x> auto_max_over_mean=<y>`` for Llama 3 8B on 4 stages.
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from strategies.core.shape import ModelShape
from strategies.planner.layout import Layout, Workload
from strategies.planner.time import Cluster, auto_split_points, stage_costs
from trainer.model_node import instantiate_model

CASES = [  # (model preset, vocabulary, seq_len, micro-batch rows, cluster, pp, stages per rank, schedule)
    ("llama3_8b", 128256, 8192, 1, "h100x8", 4, 1, "1F1B"),
    ("llama3_8b", 128256, 8192, 1, "h100x8", 2, 1, "1F1B"),
    ("llama3_8b", 128256, 8192, 1, "h100x8", 4, 2, "Interleaved1F1B"),
    ("llama3_1b", 128256, 4096, 1, "h100x8", 4, 1, "1F1B"),
    ("nano", 4096, 64, 2, "cpu", 2, 1, "1F1B"),  # the PP equivalence test's model (4 layers)
]


def imbalance(costs: list[float]) -> float:
    return max(costs) / (sum(costs) / len(costs))


def main() -> None:
    print(
        "| model | vocab | seq x rows | cluster | pp x v | layer-count split: max/mean | auto split points | auto: max/mean |"
    )
    print("|---|---|---|---|---|---|---|---|")
    headline = None
    for preset, vocab, seq_len, rows, cluster_name, pp, v, schedule in CASES:
        model = OmegaConf.load(f"conf/model/{preset}.yaml")
        if preset == "nano":
            model.n_layers = 4
        with torch.device("meta"):
            shape = ModelShape.from_model(instantiate_model(model, vocab_size=vocab))
        cluster = Cluster(**OmegaConf.to_container(OmegaConf.load(f"conf/cluster/{cluster_name}.yaml")))
        work = Workload(
            seq_len=seq_len, global_batch_size=32, compute_dtype="fp32" if cluster.device == "cpu" else "bf16"
        )
        layout = Layout(pp=pp, stages_per_rank=v, pp_schedule=schedule, micro_batch_size=rows)
        points = auto_split_points(shape, layout, work, cluster)
        before, after = (
            imbalance(stage_costs(shape, layout, work, cluster)),
            imbalance(stage_costs(shape, layout.with_(split_points=tuple(points)), work, cluster)),
        )
        print(
            f"| {preset}{' (4 layers)' if preset == 'nano' else ''} | {vocab} | {seq_len} x {rows} | {cluster_name} | {pp} x {v} | "
            f"{before:.3f} | {points} | {after:.3f} |"
        )
        headline = headline or (before, after)
    print(f"RESULT layers_max_over_mean={headline[0]:.3f} auto_max_over_mean={headline[1]:.3f}")


if __name__ == "__main__":
    main()
