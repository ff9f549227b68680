"""Unit tests for trainer.models.moe: routing, router losses, grouped experts, the MoE layer (CPU, seconds).

The references are written here: per-token loops over the chosen experts, and the losses' formulas
evaluated by hand on small examples.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.models.moe import MoE, clamped_swiglu, expert_swiglu, grouped_mm_supported
from trainer.models.moe_router import balance_loss_sum, route, z_loss_sum


def log(*values: float) -> torch.Tensor:
    return torch.tensor([math.log(v) for v in values])


# ---------------------------------------------------------------------------------------------- routing
def test_softmax_top2_weights_by_hand():
    # softmax(log [1, 2, 3, 4]) = [.1, .2, .3, .4]: top-2 = experts 3, 2 with 0.4 and 0.3.
    logits = torch.stack([log(1, 2, 3, 4), log(4, 3, 2, 1)])
    r = route(logits, top_k=2, norm_topk=False)
    assert r.experts_nk.tolist() == [[3, 2], [0, 1]]
    torch.testing.assert_close(r.weights_nk, torch.tensor([[0.4, 0.3], [0.4, 0.3]]))
    normed = route(logits, top_k=2, norm_topk=True, route_scale=2.0)
    torch.testing.assert_close(normed.weights_nk, torch.tensor([[8 / 7, 6 / 7], [8 / 7, 6 / 7]]))


def test_sigmoid_bias_steers_the_choice_not_the_weights():
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0]])  # sigmoid: .5, .5, .5, .881
    bias = torch.tensor([0.0, 0.1, 0.2, -1.0])  # selection scores .5, .6, .7, -.119
    r = route(logits, top_k=2, score_func="sigmoid", expert_bias_e=bias, norm_topk=False)
    assert r.experts_nk.tolist() == [[2, 1]]
    torch.testing.assert_close(r.weights_nk, torch.tensor([[0.5, 0.5]]))
    plain = route(logits, top_k=1, score_func="sigmoid", norm_topk=False)
    assert plain.experts_nk.tolist() == [[3]]
    torch.testing.assert_close(plain.weights_nk, torch.tensor([[1 / (1 + math.exp(-2.0))]]))


def test_group_limited_routing_scores_groups_by_their_top2_sum():
    """3 groups of 2 experts (sigmoid scores .9 .1 | .62 .58 | .5 .45), one group allowed: the
    middle group's top-2 sum (1.2) beats the first's (1.0, though it holds the best expert, .9),
    so both experts come from it; ungrouped, the top-2 are experts 0 and 2."""
    p = torch.tensor([[0.9, 0.1, 0.62, 0.58, 0.5, 0.45]])
    logits = torch.log(p / (1 - p))
    grouped = route(logits, top_k=2, score_func="sigmoid", norm_topk=False, n_group=3, topk_group=1)
    assert grouped.experts_nk.tolist() == [[2, 3]]
    torch.testing.assert_close(grouped.weights_nk, torch.tensor([[0.62, 0.58]]))
    assert route(logits, top_k=2, score_func="sigmoid", norm_topk=False).experts_nk.tolist() == [[0, 2]]
    # The bias counts in the groups' scores: +0.3 on expert 4 makes group 2 (.8 + .45) the best.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3, 0.0])
    biased = route(logits, top_k=2, score_func="sigmoid", expert_bias_e=bias, n_group=3, topk_group=1)
    assert biased.experts_nk.tolist() == [[4, 5]]


def test_balance_loss_by_hand():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    # One row, both tokens pick experts {3, 2}: f = 2 * E / (K T) = 2 for experts 2 and 3,
    # P = probs, L = 2 * .3 + 2 * .4 = 1.4; summed over the row's T = 2 tokens: 2.8.
    scores = probs.expand(1, 2, 4)
    experts = torch.tensor([[[3, 2], [3, 2]]])
    torch.testing.assert_close(balance_loss_sum(scores, experts), torch.tensor(2.8))
    # Uniform routing (every expert once per row) gives L = 1 whatever the scores.
    uniform = torch.tensor([[[0, 1], [2, 3]]])
    torch.testing.assert_close(balance_loss_sum(scores, uniform), torch.tensor(2.0))
    # Sigmoid scores are normalised per token first: [1, 1, 1, 1] -> [.25] * 4.
    torch.testing.assert_close(balance_loss_sum(torch.ones(1, 2, 4), experts), torch.tensor(2.0))
    # Per row: two rows of the same data sum their losses.
    torch.testing.assert_close(balance_loss_sum(scores.expand(2, 2, 4), experts.expand(2, 2, 2)), torch.tensor(5.6))


def test_z_loss_by_hand():
    logits = torch.stack([log(1, 2, 3, 4), torch.zeros(4)])  # logsumexp: ln 10 and ln 4
    torch.testing.assert_close(z_loss_sum(logits), torch.tensor(math.log(10) ** 2 + math.log(4) ** 2))


# ---------------------------------------------------------------------------------------------- experts
def _weights(E: int, D: int, Fh: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(E, Fh, D, generator=g) / D**0.5,
        torch.randn(E, D, Fh, generator=g) / Fh**0.5,
        torch.randn(E, Fh, D, generator=g) / D**0.5,
    ]


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 16, 0], [1, 2, 3, 10]])
def test_grouped_mm_equals_the_per_expert_loop(counts):
    D, Fh = 16, 24
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(2))
    counts_e = torch.tensor(counts)
    results = []
    # The grouped kernel as on CPU, with groups padded to 8 rows as on CUDA, and the loop.
    for grouped, align in ((True, 1), (True, 8), (False, 1)):
        xs = x.clone().requires_grad_()
        ws = [w.requires_grad_() for w in _weights(len(counts), D, Fh)]
        assert grouped_mm_supported(xs, *ws)
        y = expert_swiglu(xs, counts_e, ws[0], ws[1], ws[2], grouped=grouped, align_rows=align)
        y.backward(grad)
        results.append([y.detach(), xs.grad] + [w.grad for w in ws])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # The loop itself against a per-row formula.
    w1, w2, w3 = _weights(len(counts), D, Fh)
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts_e)
    rows = [w2[e] @ (F.silu(w1[e] @ x[m]) * (w3[e] @ x[m])) for m, e in enumerate(owner.tolist())]
    torch.testing.assert_close(results[2][0], torch.stack(rows), rtol=0, atol=1e-6)


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [1, 2, 3, 10]])
def test_gpt_oss_experts_with_biases_and_the_clamped_swiglu_grouped_padded_and_looped_agree(counts):
    """Expert biases (each row its expert's) and GPT-OSS's clamped SwiGLU: the grouped kernel, its
    8-row padded groups and the loop give the same outputs and gradients, and the loop is the
    per-row formula of transformers' GptOssExperts (gate clamped above, up on both sides, up + 1)."""
    D, Fh, E, alpha, limit = 16, 24, len(counts), 1.702, 0.3
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    biases = [0.3 * torch.randn(E, n, generator=gen) for n in (Fh, D, Fh)]
    gate = functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
    results = []
    for grouped, align in ((True, 1), (True, 8), (False, 1)):
        xs = x.clone().requires_grad_()
        ws = [w.requires_grad_() for w in _weights(E, D, Fh)]
        bs = [b.clone().requires_grad_() for b in biases]
        y = expert_swiglu(xs, torch.tensor(counts), *ws, grouped=grouped, align_rows=align, biases=tuple(bs), gate=gate)
        y.backward(grad)
        results.append([y.detach(), xs.grad] + [t.grad for t in ws + bs])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    w1, w2, w3 = _weights(E, D, Fh)
    owner = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    rows, clamped = [], 0
    for m, e in enumerate(owner.tolist()):
        g, u = w1[e] @ x[m] + biases[0][e], w3[e] @ x[m] + biases[2][e]
        clamped += int((g > limit).sum() + (u.abs() > limit).sum())
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        rows.append(w2[e] @ ((u + 1) * g * torch.sigmoid(alpha * g)) + biases[1][e])
    assert clamped > 0  # the clamps bind on these rows
    torch.testing.assert_close(results[2][0], torch.stack(rows), rtol=0, atol=1e-6)


def test_grouped_mm_needs_16_byte_strides_on_cpu():
    x = torch.randn(4, 6)  # 24-byte rows
    assert not grouped_mm_supported(x, torch.randn(2, 8, 6))
    assert grouped_mm_supported(torch.randn(4, 8), torch.randn(2, 8, 8))
    assert not grouped_mm_supported(torch.randn(4, 8, dtype=torch.float64), torch.randn(2, 8, 8, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- the layer
def reference_moe(x_btd, gate_ed, w1, w2, w3, shared, *, top_k):
    """Token by token: softmax scores, top-k, renormalised weights, sum of the chosen SwiGLUs."""
    out = []
    for x in x_btd.reshape(-1, x_btd.shape[-1]):
        probs = torch.softmax(gate_ed @ x, -1)
        top = torch.topk(probs, top_k).indices
        weights = probs[top] / probs[top].sum()
        y = sum(wt * (w2[e] @ (F.silu(w1[e] @ x) * (w3[e] @ x))) for wt, e in zip(weights, top.tolist()))
        sw1, sw2, sw3 = shared
        out.append(y + sw2 @ (F.silu(sw1 @ x) * (sw3 @ x)))
    return torch.stack(out).view_as(x_btd)


def _layer(seed: int = 0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(16, 8, 4, 2, num_shared_experts=1, **kwargs)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_layer_equals_a_per_token_loop(grouped):
    moe = _layer()
    moe.experts.grouped = grouped
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    grad = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
    moe(x).backward(grad)
    params = [
        moe.router.gate.weight,
        moe.experts.w1,
        moe.experts.w2,
        moe.experts.w3,
        moe.shared_experts.w1.weight,
        moe.shared_experts.w2.weight,
        moe.shared_experts.w3.weight,
    ]
    refs = [p.detach().clone().requires_grad_() for p in params]
    x_ref = x.detach().clone().requires_grad_()
    ref = reference_moe(x_ref, *refs[:4], refs[4:], top_k=2)
    ref.backward(grad)
    # Other summation orders than the loop's: fp32 rounding of values of size ~3.
    torch.testing.assert_close(moe(x.detach()), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for p, r in zip(params, refs):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)


def test_a_compiled_float32_moe_layer_equals_a_per_token_loop():
    """Compiled (aot_eager traces what inductor takes), float32 experts with the automatic kernel
    choice run their loop: torch 2.13's meta kernel of _grouped_mm, which compile traces with,
    takes bfloat16 only (`grouped_mm_supported`; before, the first forward raised)."""
    moe = _layer()
    assert moe.experts.grouped is None  # the automatic choice: grouped in eager float32 on CPU
    moe.compile(backend="aot_eager")
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    grad = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
    moe(x).backward(grad)
    refs = [p.detach().clone().requires_grad_() for p in (moe.router.gate.weight, moe.experts.w1, moe.experts.w2)]
    refs += [moe.experts.w3.detach().clone().requires_grad_()]
    shared = [w.weight.detach() for w in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3)]
    x_ref = x.detach().clone().requires_grad_()
    ref = reference_moe(x_ref, *refs, shared, top_k=2)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for p, r in zip((moe.router.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3), refs):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)


def test_router_losses_enter_the_gradient_with_the_step_scale():
    coef, z_coef, scale = 0.5, 0.1, 1 / 7
    moe = _layer(balance_coef=coef, z_loss_coef=z_coef)
    moe.router_loss_scale = scale
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
    moe(x).backward(grad)
    got = moe.router.gate.weight.grad.clone()

    # The same objective written out: <out, grad> + scale * (coef * balance + z_coef * z), both by formula.
    plain = _layer()  # the same weights, no router losses
    gate = plain.router.gate.weight
    out = plain(x)
    logits = x.reshape(-1, 16) @ gate.T
    probs = logits.softmax(-1).view(2, 5, 4)
    top = probs.topk(2, dim=-1).indices
    balance = 0.0
    for b in range(2):
        f = torch.zeros(4)
        for t in range(5):
            f[top[b, t]] += 4 / (2 * 5)
        balance = balance + 5 * (f * probs[b].mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).sum()
    ((out * grad).sum() + scale * (coef * balance + z_coef * z)).backward()
    torch.testing.assert_close(got, plain.router.gate.weight.grad, rtol=0, atol=1e-6)
    assert moe.statistics[-1].item() == 10 and moe.statistics[:4].sum().item() == 20


def test_padding_is_left_out_of_the_router_losses_statistics_and_scale():
    """Rows of 3 and 5 real tokens padded to 5 (the padding random, so routed somewhere): the loads,
    the balance and z sums, the token count and the router losses' gradient (at the micro-batch's
    own scale, 1 / its 8 real tokens) are those of the real tokens alone, by formula."""
    coef, z_coef = 0.5, 0.1
    moe = _layer(balance_coef=coef, z_loss_coef=z_coef)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    (moe(x, real) * 0).sum().backward()  # the experts' outputs give the gate no gradient: the router losses alone
    got = moe.router.gate.weight.grad.clone()

    gate = _layer().router.gate.weight
    logits = x.reshape(-1, 16) @ gate.T
    probs = logits.softmax(-1).view(2, 5, 4)
    top = probs.topk(2, dim=-1).indices
    balance, loads = 0.0, torch.zeros(4)
    for b, length in enumerate((3, 5)):
        f = torch.zeros(4)
        for t in range(length):
            f[top[b, t]] += 4 / (2 * length)
            loads[top[b, t]] += 1
        balance = balance + length * (f * probs[b, :length].mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).view(2, 5)[real].sum()
    ((coef * balance + z_coef * z) / 8).backward()
    torch.testing.assert_close(got, gate.grad, rtol=0, atol=1e-6)
    expected = torch.cat([loads, torch.stack([balance.detach(), z.detach(), torch.tensor(8.0)])])
    torch.testing.assert_close(moe.statistics, expected, rtol=1e-6, atol=1e-6)


def test_a_row_of_padding_alone_adds_nothing():
    moe = _layer(balance_coef=1.0, z_loss_coef=1.0)
    x = torch.randn(1, 4, 16, requires_grad=True)
    moe(x, torch.zeros(1, 4, dtype=torch.bool)).sum().backward()
    assert moe.statistics.abs().sum().item() == 0  # no load, no loss, no token; and no 0/0
    assert torch.isfinite(moe.router.gate.weight.grad).all()


def test_statistics_counted_once_per_forward_under_checkpointing_and_repeated_backward_and_not_in_eval():
    moe = _layer()
    x = torch.randn(2, 5, 16, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.statistics[-1].item() == 10
    assert moe.router.tokens_per_expert.sum().item() == 20
    with torch.no_grad():
        moe(x)
    assert moe.statistics[-1].item() == 10
    # A pipeline schedule's autograd.grad for gradient shapes, then the real backward: counted once.
    out = moe(x).sum()
    torch.autograd.grad(out, x, retain_graph=True)
    out.backward()
    assert moe.statistics[-1].item() == 20


def test_expert_bias_update_rule():
    moe = _layer()
    moe.router.update_expert_bias(torch.tensor([3.0, 1.0, 2.0, 2.0]), rate=0.01)
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
