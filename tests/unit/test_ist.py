"""Independent Subnet Training without processes: the split, the reassembly, the bytes and the checks.

The two islands run in two threads of this process; their all-gather is a stand-in that hands each
thread both islands' messages (the rest is plait's code: `IST.split_` and `IST.reassemble_`). The
collective itself, the shared average and training are covered in gloo ranks by tests/dist/test_ist_runs.py.
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch
from harness import compose_config

import strategies.local_sgd.ist as ist_module
from strategies.core.shape import ModelShape
from strategies.local_sgd import IST
from strategies.local_sgd.ist import allgather_bytes_sent
from strategies.local_sgd.units import split_units
from strategies.planner.layout import Layout, Workload
from strategies.planner.memory import predict_rank, state_bytes
from trainer.config import ConfigError, validate
from trainer.models.llama import Llama
from trainer.planning import planner_inputs

MLP = ("w1", "w2", "w3")


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)  # ffn_dim 192


def _islands(
    model: Llama, optimizer: torch.optim.Optimizer, num: int = 2
) -> list[tuple[IST, Llama, torch.optim.Optimizer]]:
    """``num`` islands: a copy of the model and its optimizer each, an IST plugin bound to them."""
    out = []
    for island in range(num):
        m, opt = copy.deepcopy((model, optimizer))
        plugin = IST(sync_every=1, split_seed=3)
        plugin.setup(m, group=None)
        plugin.num_islands, plugin.island = num, island
        out.append((plugin, m, opt))
    return out


def _threaded_gather(num: int):
    """An all-gather for ``num`` threads (one per island): each puts its message, all read all."""
    slots, barrier = [None] * num, threading.Barrier(num)
    rank = threading.local()

    def all_gather(received, flat, group=None):
        slots[rank.value] = flat.clone()
        barrier.wait()
        for out, sent in zip(received, slots):
            out.copy_(sent)
        barrier.wait()

    return SimpleNamespace(all_gather=all_gather), rank


def _reassemble_all(islands, monkeypatch) -> list[float]:
    fake, rank = _threaded_gather(len(islands))
    monkeypatch.setattr(ist_module, "dist", fake)
    sent = [0.0] * len(islands)

    def run(i: int) -> None:
        rank.value = i
        plugin, _, opt = islands[i]
        sent[i] = plugin.reassemble_(opt)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(islands))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent


def _adamw_after_one_step(model: Llama) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 256, (2, 8))).float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def test_split_is_a_disjoint_cover_of_equal_groups_redrawn_each_round() -> None:
    rounds = [split_units([192, 192], 2, seed=3, round_index=r) for r in range(2)]
    for groups in rounds:
        for per_mlp in groups:
            assert [len(g) for g in per_mlp] == [96, 96]
            assert torch.equal(torch.cat(per_mlp).sort().values, torch.arange(192))
        assert not torch.equal(groups[0][0], groups[1][0])  # each MLP its own permutation
    assert not torch.equal(rounds[0][0][0], rounds[1][0][0])  # a new split each round
    again = split_units([192, 192], 2, seed=3, round_index=1)
    assert all(torch.equal(a, b) for x, y in zip(again, rounds[1]) for a, b in zip(x, y))  # every island draws it
    with pytest.raises(ValueError, match="ffn_dim=192 is not divisible by 5 islands"):
        split_units([192], 5, seed=0, round_index=0)


def test_each_of_two_islands_holds_half_of_the_mlp_units() -> None:
    model = _model()
    full_mlp = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in MLP)
    shared = sum(p.numel() for p in model.parameters()) - full_mlp
    assert full_mlp == 2 * 3 * 64 * 192
    islands = _islands(model, torch.optim.AdamW(model.parameters()))
    held = []
    for plugin, m, opt in islands:
        plugin.split_(opt)
        mlp = sum(p.numel() for n, p in m.named_parameters() if n.split(".")[-2] in MLP)
        assert mlp == full_mlp // 2 and sum(p.numel() for p in m.parameters()) == shared + full_mlp // 2
        assert m.layers["0"].feed_forward.w1.weight.shape == (96, 64)
        assert m.layers["0"].feed_forward.w2.weight.shape == (64, 96)
        held.append(plugin.groups[0][plugin.island])
    assert not set(held[0].tolist()) & set(held[1].tolist())


def test_split_then_reassemble_is_the_identity_bitwise(monkeypatch) -> None:
    """Parameters and AdamW moments, after a split and no step, reassemble to exactly what they
    were; the optimizer keeps the same parameter objects throughout."""
    model = _model()
    optimizer = _adamw_after_one_step(model)
    islands = _islands(model, optimizer)
    before = [[id(p) for p in m.parameters()] for _, m, _ in islands]
    for plugin, _, opt in islands:
        plugin.split_(opt)
    assert islands[0][2].state[islands[0][1].layers["0"].feed_forward.w1.weight]["exp_avg"].shape == (96, 64)
    sent = _reassemble_all(islands, monkeypatch)
    # One all-gather of each island's half of the MLPs (weights and two moments, fp32) to the other island.
    assert sent == [442_368.0, 442_368.0] == [allgather_bytes_sent(4 * 3 * (2 * 3 * 64 * 96), 2)] * 2
    for (plugin, m, opt), ids in zip(islands, before):
        assert plugin.groups is None and [id(p) for p in m.parameters()] == ids
        for (name, p), p0 in zip(m.named_parameters(), model.parameters()):
            assert torch.equal(p, p0), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], optimizer.state[p0][key]), (name, key)


def test_reassembly_puts_each_islands_units_in_their_places(monkeypatch) -> None:
    """A change an island makes to its narrow w2 lands in the full w2's columns of its units."""
    model = _model()
    islands = _islands(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for plugin, m, opt in islands:
        plugin.split_(opt)
        with torch.no_grad():
            m.layers["1"].feed_forward.w2.weight.fill_(plugin.island + 1.0)
    _reassemble_all(islands, monkeypatch)
    w2 = islands[0][1].layers["1"].feed_forward.w2.weight
    groups = split_units([192, 192], 2, seed=3, round_index=0)[1]
    for island, group in enumerate(groups):
        assert (w2[:, group] == island + 1.0).all()


def test_allgather_bytes() -> None:
    assert allgather_bytes_sent(1000, 1) == 0.0
    assert allgather_bytes_sent(1000, 2) == 1000.0
    assert allgather_bytes_sent(1000, 4) == 3000.0


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(list(overrides)))
    return err.value.problems


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.devices=4", "strategy.dp_shard=2"], "strategy.dp_shard=2; use strategy.dp_shard=1"),
        (["strategy.compile.enabled=true"], "set strategy.compile.enabled=false"),
        (["optim=muon"], "use optim=adamw"),
        (["trainer.devices=5", "train.global_batch_size=10"], "use a number of islands that divides 192"),
        (["+strategy/sat=default"], "does not compose with strategy.sat yet; use strategy.sat=null"),
        (["+strategy/mixout=default"], "does not compose with strategy.mixout yet; use strategy.mixout=null"),
        (["+strategy/lora=default"], "strategy=ist trains the base weights; set strategy.lora=null"),
    ],
    ids=["dp_shard", "compile", "muon", "indivisible", "sat", "mixout", "lora"],
)
def test_what_ist_does_not_support_is_refused_naming_the_fix(overrides: list[str], message: str) -> None:
    problems = _problems("strategy=ist", "trainer.devices=2", *overrides)
    assert any(message in p for p in problems), problems


def test_ist_refuses_a_mixture_of_experts() -> None:
    from harness import MOE_SMALL

    problems = _problems(*MOE_SMALL, "strategy=ist", "trainer.devices=2")
    assert any("splits dense MLPs only" in p and "strategy=diloco" in p for p in problems), problems


def test_ist_validates() -> None:
    validate(compose_config(["strategy=ist", "trainer.devices=2"]))


def test_the_planner_counts_the_state_an_island_holds() -> None:
    """Parameters, gradients and AdamW state of island 0 after its split and one step, byte for
    byte as `state_bytes` predicts them for a layout of 2 IST islands; activations and the total
    go down against DDP, and the reassembly's gathered MLPs are the transient."""
    model = _model()
    shape, work = ModelShape.from_model(model), Workload(seq_len=8, global_batch_size=4)
    plugin, island, opt = _islands(model, torch.optim.AdamW(model.parameters(), lr=1e-2))[0]
    plugin.split_(opt)
    island(torch.randint(0, 256, (2, 8))).float().logsumexp(-1).mean().backward()
    grads = sum(4 * p.grad.numel() for p in island.parameters())
    opt.step()
    held = sum(4 * p.numel() for p in island.parameters())
    state = sum(4 * t.numel() for s in opt.state.values() for t in s.values())  # moments and the fp32 step
    assert state_bytes(shape, Layout(dp_replicate=2, ist_islands=2), work, 0) == (held, grads, state)
    ist, ddp = (predict_rank(shape, Layout(dp_replicate=2, ist_islands=i), work, 0, device="cpu") for i in (2, 1))
    assert ist.activations < ddp.activations and ist.params < ddp.params
    mlp = 2 * 3 * 64 * 96 * 4 * 3  # island 0's half of the MLPs, weights and two moments, fp32
    assert ist.transient == max(ddp.transient, 5 * mlp - ist.grads - ist.activations)


def test_the_planner_reads_ist_from_the_run() -> None:
    cfg = compose_config(["strategy=ist", "trainer.devices=2"])
    _, layout, _ = planner_inputs(cfg, validate(cfg))
    assert layout.ist_islands == 2
    cfg = compose_config(["strategy=diloco", "trainer.devices=2"])
    assert planner_inputs(cfg, validate(cfg))[1].ist_islands == 1


def test_a_load_in_the_middle_of_a_round_restores_the_full_checkpoint(tmp_path) -> None:
    """A rollback (train.nonfinite=rollback) loads a checkpoint while the MLPs are narrow: the
    full-shape weights and moments come back exactly, and the next step splits them again."""
    model = _model()
    optimizer = _adamw_after_one_step(model)
    plugin, island, opt = _islands(model, optimizer)[0]
    plugin.save_checkpoint(tmp_path / "ckpt", model=island, optimizers=[opt], meta={"global_step": 1})
    plugin.split_(opt)
    plugin.load_checkpoint(tmp_path / "ckpt", model=island, optimizers=[opt])
    assert plugin.groups is None
    for (name, p), p0 in zip(island.named_parameters(), model.parameters()):
        assert torch.equal(p, p0), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], optimizer.state[p0][key]), (name, key)


def test_float8_is_refused_by_validate_naming_the_fix() -> None:
    from harness import compose_config

    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match="set strategy.float8.recipe=null"):
        validate(compose_config(["strategy=ist", "trainer.devices=2", "strategy.float8.recipe=tensorwise"]))
