"""The chunked LM-head cross-entropy equals the full-logits one (fp32: loss and gradients to 1e-6)."""

import pytest
import torch

from trainer.objectives.chunked_loss import chunked_token_loss_sum
from trainer.objectives.pretrain import IGNORE_INDEX, token_loss_sum


def _grads(fn, hidden, weight):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_equals_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 10, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (3, 10), generator=g)
    labels[0, :4] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    full = _grads(lambda h, w: token_loss_sum(h @ w.t(), labels), hidden, weight)
    chunked = _grads(lambda h, w: chunked_token_loss_sum(h, w, labels, chunk_tokens=chunk), hidden, weight)
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert full[1][0, :4].abs().sum() == 0  # unsupervised positions get no gradient


def test_no_supervised_token_gives_exactly_zero():
    hidden, weight = torch.randn(1, 4, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    loss = chunked_token_loss_sum(hidden, weight, torch.full((1, 4), IGNORE_INDEX), chunk_tokens=2)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        chunked_token_loss_sum(
            torch.zeros(1, 1, 2), torch.zeros(3, 2), torch.zeros(1, 1, dtype=torch.long), chunk_tokens=0
        )


def test_no_host_sync_and_autocast_precision_in_backward():
    """No nonzero/boolean index (a device sync on CUDA) anywhere; under bf16 autocast every GEMM
    (logits, and the two gradient GEMMs computed with them) takes bf16 operands; none is recomputed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.ops.append((func, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    hidden, weight = (
        torch.randn(2, 6, 8, generator=g, requires_grad=True),
        torch.randn(11, 8, generator=g, requires_grad=True),
    )
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, :3] = IGNORE_INDEX
    with Record() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_token_loss_sum(hidden, weight, labels, chunk_tokens=5)
        loss.backward()
    names = {f.__name__ for f, _ in rec.ops}
    assert not names & {"nonzero.default", "index.Tensor", "masked_select.default"}, names
    gemms = [dtypes for f, dtypes in rec.ops if f in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    # 3 chunks x (logits, grad of hidden, grad of weight)
    assert len(gemms) == 3 * 3 and all(set(d) == {torch.bfloat16} for d in gemms), gemms
