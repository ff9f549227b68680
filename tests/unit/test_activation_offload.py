"""Activation offload (save_on_cpu per block) changes where saved tensors live, never the numbers."""

import copy

import torch

from strategies.activation_checkpoint import apply_activation_checkpointing
from strategies.activation_offload import apply_activation_offload
from trainer.models.llama import Llama


def _loss_and_grads(model: Llama, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(ids).float().logsumexp(-1).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_offloaded_blocks_train_identically(monkeypatch):
    torch.manual_seed(0)
    model = Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    offloaded, both = copy.deepcopy(model), copy.deepcopy(model)
    assert apply_activation_offload(offloaded) == 2
    apply_activation_checkpointing(both, mode="full")
    apply_activation_offload(both)
    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):  # counts the tensors the offload hooks pack
        def __init__(self, pin_memory: bool = False) -> None:
            super().__init__(pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(1) or pack(t)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    ids = torch.randint(0, 64, (2, 16))
    expected = _loss_and_grads(model, ids)
    for variant in (offloaded, both):
        packed.clear()
        got = _loss_and_grads(variant, ids)
        assert packed, "no saved tensor went through the offload hooks"
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
