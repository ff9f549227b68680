"""Activation checkpointing and per-block compile: same numbers, same names, fewer saved activations."""

from __future__ import annotations

import copy

import pytest
import torch

from strategies.activation_checkpoint import ActivationCheckpoint, apply_activation_checkpointing, is_checkpointed
from strategies.checkpoint import dcp as ckpt
from strategies.compile import Compile
from trainer.models.llama import Llama


def tiny_llama(n_layers: int = 2) -> Llama:
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=16)


def loss_and_grads(model: Llama, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids).float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def num_saved_tensors(model: Llama, input_ids: torch.Tensor) -> int:
    """Tensors autograd keeps for the backward of one forward (recomputed ones are not kept)."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids).sum().backward()
    return count


INPUT_IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def test_full_checkpointing_gives_bitwise_equal_loss_and_grads() -> None:
    ref_loss, ref_grads = loss_and_grads(tiny_llama(), INPUT_IDS)
    model = tiny_llama()
    assert apply_activation_checkpointing(model, mode="full") == ["0", "1"]
    loss, grads = loss_and_grads(model, INPUT_IDS)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def test_checkpointed_blocks_keep_fewer_activations_and_recompute_them() -> None:
    plain, checkpointed = tiny_llama(), tiny_llama()
    apply_activation_checkpointing(checkpointed, mode="full")
    assert num_saved_tensors(checkpointed, INPUT_IDS) < num_saved_tensors(plain, INPUT_IDS) / 2

    calls = []
    checkpointed.layers["0"].feed_forward.register_forward_pre_hook(lambda *_: calls.append(1))
    checkpointed(INPUT_IDS).sum().backward()
    assert len(calls) == 2  # the forward, and its recomputation in the backward


def test_selective_checkpointing_keeps_matmuls_and_recomputes_the_rest() -> None:
    """Bitwise equal loss and grads; the backward runs no forward matmul again (full does)."""
    ref_loss, ref_grads = loss_and_grads(tiny_llama(), INPUT_IDS)
    model = tiny_llama()
    apply_activation_checkpointing(model, mode="selective")
    loss, grads = loss_and_grads(model, INPUT_IDS)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    full = tiny_llama()
    apply_activation_checkpointing(full, mode="full")

    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    runs = []
    for m in (tiny_llama(), model, full):
        out = m(INPUT_IDS).sum()
        with CountMatmuls() as counter:
            out.backward()
        runs.append(counter.n)
    assert runs[0] == runs[1] < runs[2], runs  # (none, selective, full) matmuls in the backward


def test_every_k_picks_every_kth_block_from_the_first() -> None:
    model = tiny_llama(n_layers=5)
    assert apply_activation_checkpointing(model, mode="every_k", every_k=2) == ["0", "2", "4"]
    assert [is_checkpointed(b) for b in model.layers.values()] == [True, False, True, False, True]
    assert apply_activation_checkpointing(tiny_llama(), mode="none") == []


def test_names_state_dict_and_deepcopy_are_unchanged() -> None:
    plain, model = tiny_llama(), tiny_llama()
    ActivationCheckpoint(mode="full").apply(model)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())
    copied = copy.deepcopy(model)
    assert copied.layers["0"].forward.args[0] is copied.layers["0"]  # bound to the copy, not the original


def test_dcp_checkpoint_loads_across_checkpointing_on_and_off(tmp_path) -> None:
    saved = tiny_llama()
    ActivationCheckpoint(mode="full").apply(saved)
    opt = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    loss_and_grads(saved, INPUT_IDS)
    opt.step()
    ckpt.save(tmp_path / "step", model=saved, optimizers=[opt], meta={})

    torch.manual_seed(123)
    loaded = Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)  # no AC
    loaded_opt = torch.optim.SGD(loaded.parameters(), lr=0.1, momentum=0.9)
    ckpt.load(tmp_path / "step", model=loaded, optimizers=[loaded_opt])
    for (name, p), q in zip(saved.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(opt.state[p]["momentum_buffer"], loaded_opt.state[q]["momentum_buffer"]), name


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(ValueError, match="activation_checkpoint.mode='partial'.*none, full, every_k, selective"):
        ActivationCheckpoint(mode="partial")
    with pytest.raises(ValueError, match="every_k=0 must be >= 1"):
        apply_activation_checkpointing(tiny_llama(), mode="every_k", every_k=0)


def test_compile_per_block_with_checkpointing_matches_eager() -> None:
    # aot_eager traces and partitions the graphs like inductor but skips code generation (seconds,
    # not a minute, on 2 cores); inductor itself is what the default backend runs.
    ref_loss, ref_grads = loss_and_grads(tiny_llama(), INPUT_IDS)
    model = tiny_llama()
    ActivationCheckpoint(mode="full").apply(model)
    Compile(enabled=True, backend="aot_eager").apply(model)
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == list(ref_grads)
    loss, grads = loss_and_grads(model, INPUT_IDS)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6)
    Compile(enabled=False).apply(plain := tiny_llama())
    assert all(block._compiled_call_impl is None for block in plain.layers.values())
