"""``planner.calibrate=true``: refused for a GPU preset (the probes measure this host, and would
replace the preset's rates), and its gloo link probe forks one node's ranks, never the cluster's."""

from __future__ import annotations

import pytest

from strategies.planner import calibrate as cal
from trainer.compose import compose
from trainer.config import ConfigError, validate
from trainer.planning import cluster_from_config, plan


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The probes replaced by constants; returns the world sizes gloo_link was asked for."""
    links: list[int] = []
    monkeypatch.setattr(cal, "matmul_flops", lambda: 1e10)
    monkeypatch.setattr(cal, "attention_flops", lambda: 5e9)
    monkeypatch.setattr(cal, "memory_bandwidth", lambda: 1e9)
    monkeypatch.setattr(cal, "gloo_link", lambda n=2: links.append(n) or (1e-4, 1e9))
    monkeypatch.setattr(cal, "layer_overhead", lambda *a, **k: 1e-3)
    monkeypatch.setattr(cal, "dtensor_overhead_factor", lambda *a, **k: 2.0)
    return links


def test_a_gpu_preset_is_refused_before_any_probe(probes: list[int]) -> None:
    # Before: h100x512's rates became this CPU's, after forking 512 gloo processes.
    cfg = compose("pretrain", ["model=tiny", "cluster=h100x512", "planner.calibrate=true"])
    with pytest.raises(
        ConfigError, match=r"would replace cluster=h100x512's cuda figures.*use planner.calibrate=false"
    ):
        plan(cfg, validate(cfg))
    assert probes == []


def test_a_cpu_preset_measures_the_links_of_one_node(probes: list[int]) -> None:
    cfg = compose("pretrain", ["model=tiny", "cluster=cpu", "trainer.devices=2", "trainer.num_nodes=64"])
    cluster = cal.calibrate_cluster(cluster_from_config(cfg), block=(None, ()), model_fn=lambda v: None)
    assert probes == [2]  # before: 128 (the cluster's world size)
    assert cluster.peak_flops == 1e10 and cluster.intra_node_bandwidth == 1e9 and cluster.num_nodes == 64
