"""plait's Muon (`strategies.muon.Muon`, ``optim=muon``) on one process equals an independent Muon
written here, its state round-trips a checkpoint bitwise, and the planner counts that state.

The reference follows Keller Jordan's ``muon.py`` (github.com/KellerJordan/Muon,
``zeropower_via_newtonschulz5`` and ``muon_update``): momentum ``lerp``, Nesterov, the quintic
Newton-Schulz iteration (fp32 here, plait's ``ns_dtype=float32``), Moonlight's ``0.2 sqrt(max(A, B))``
update scale and decoupled weight decay, on the blocks' 2-D matrices; torch's own AdamW
(``foreach=False``) on the embedding, the LM head (decayed) and the norms (not decayed).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from strategies.core.ranges import optimizer_problem
from strategies.core.shape import ModelShape
from strategies.muon import Muon, launch_line, takes_muon
from strategies.planner.layout import Layout, Workload, optimizer_kind
from strategies.planner.memory import state_bytes
from trainer.models.llama import Llama
from trainer.optim import build_optimizer

LR, MU, WD, BETAS, EPS = 0.01, 0.95, 0.1, (0.9, 0.95), 1e-8
VOCAB = 97


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    model.init_weights()
    return model


def _plait_muon(model: Llama, **kwargs) -> torch.optim.Optimizer:
    muon = functools.partial(Muon, lr=LR, momentum=MU, betas=BETAS, eps=EPS, ns_dtype="float32", **kwargs)
    return build_optimizer(model, muon, weight_decay=WD, no_decay=("tok_embeddings", "norm", "bias"))


def _loss(model: Llama, step: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(step))
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _train(model: Llama, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        optimizer.step()


def reference_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's ``zeropower_via_newtonschulz5``, in fp32."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.float()
    if g.size(-2) > g.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if g.size(-2) > g.size(-1):
        x = x.mT
    return x


class ReferenceMuon:
    """Muon on ``matrices`` (Keller Jordan's ``muon_update``, Nesterov) and torch's AdamW on ``others``."""

    def __init__(self, matrices: list[torch.nn.Parameter], decayed: list, undecayed: list, *, nesterov: bool = True):
        self.matrices, self.nesterov = matrices, nesterov
        self.momentum = [torch.zeros_like(p) for p in matrices]
        self.adamw = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": WD}, {"params": undecayed, "weight_decay": 0.0}],
            lr=LR, betas=BETAS, eps=EPS, foreach=False,
        )  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        for p in self.matrices:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.matrices, self.momentum):
            buf.lerp_(p.grad, 1 - MU)
            update = p.grad.lerp(buf, MU) if self.nesterov else buf
            p.mul_(1 - LR * WD)
            p.add_(reference_newton_schulz(update), alpha=-LR * 0.2 * math.sqrt(max(p.shape)))
        self.adamw.step()


def _reference(model: Llama) -> ReferenceMuon:
    named = dict(model.named_parameters())
    matrices = [p for n, p in named.items() if n.startswith("layers.") and p.ndim == 2]
    norms = [p for n, p in named.items() if p.ndim == 1]
    return ReferenceMuon(matrices, [named["output.weight"]], [named["tok_embeddings.weight"], *norms])


def test_groups_split_hidden_matrices_from_the_rest() -> None:
    model = _model()
    optimizer = _plait_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {
        (g["use_muon"], g["weight_decay"]): sorted(names[id(p)] for p in g["params"]) for g in optimizer.param_groups
    }
    assert set(kinds) == {(True, WD), (False, WD), (False, 0.0)}
    assert kinds[(False, WD)] == ["output.weight"]
    assert all(n.startswith("layers.") and n.endswith("weight") and "norm" not in n for n in kinds[(True, WD)])
    assert len(kinds[(True, WD)]) == 2 * 7  # wq, wk, wv, wo, w1, w2, w3 per block
    assert "tok_embeddings.weight" in kinds[(False, 0.0)]
    assert optimizer.param_groups[0]["use_muon"]  # the logged lr is Muon's


def test_gpt_oss_expert_biases_take_adamw_not_muon() -> None:
    """GPT-OSS's stacked expert biases ([E, F], 2-D) are no linear map: AdamW's, without decay."""
    from trainer.models.moe_transformer import MoETransformer

    model = MoETransformer(
        vocab_size=64, dim=32, n_layers=1, n_heads=4, num_experts=4, top_k=2, moe_ffn_dim=16, biases=True
    )
    optimizer = _plait_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    undecayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    biases = {f"layers.0.feed_forward.experts.{w}_bias" for w in ("w1", "w2", "w3")}
    assert biases <= undecayed and not biases & muon and "layers.0.attention.wq.weight" in muon


@pytest.mark.parametrize("steps", [1, 3])
def test_steps_equal_an_independent_muon(steps: int) -> None:
    model = _model()
    reference_model = copy.deepcopy(model)
    _train(model, _plait_muon(model), range(steps))
    _train(reference_model, _reference(reference_model), range(steps))
    moved = dict(_model().named_parameters())
    for name, param in reference_model.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], param, rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(param, moved[name]), name  # every parameter trained


def test_nesterov_false_is_plain_momentum() -> None:
    model = _model()
    reference_model = copy.deepcopy(model)
    _train(model, _plait_muon(model, nesterov=False), range(2))
    named = dict(reference_model.named_parameters())
    ref = _reference(reference_model)
    ref.nesterov = False
    _train(reference_model, ref, range(2))
    torch.testing.assert_close(dict(model.named_parameters()), named, rtol=1e-6, atol=1e-7)


def test_resume_from_state_dict_is_bit_exact() -> None:
    """2 steps, save, a fresh model and optimizer load both, 2 more = 4 uninterrupted steps, bitwise."""
    straight = _model()
    _train(straight, _plait_muon(straight), range(4))
    first = _model()
    optimizer = _plait_muon(first)
    _train(first, optimizer, range(2))
    saved = copy.deepcopy({"model": first.state_dict(), "optimizer": optimizer.state_dict()})
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    optimizer = _plait_muon(resumed)
    optimizer.load_state_dict(saved["optimizer"])
    _train(resumed, optimizer, range(2, 4))
    for (name, param), expected in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(param, expected), name


def test_planner_counts_the_state_it_keeps() -> None:
    """`state_bytes` for ``optim=muon`` = the bytes of the state plait's Muon holds after a step:
    one momentum buffer per hidden matrix, AdamW's two moments and a 4-byte step for the others."""
    model = _model()
    optimizer = _plait_muon(model)
    _train(model, optimizer, range(1))
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values())
    assert optimizer_kind(functools.partial(Muon, lr=LR)) == "muon"
    shape, layout = ModelShape.from_model(model), Layout(micro_batch_size=1)
    _, _, predicted = state_bytes(shape, layout, Workload(seq_len=16, global_batch_size=4, optimizer="muon"), 0)
    _, _, adamw = state_bytes(shape, layout, Workload(seq_len=16, global_batch_size=4, optimizer="adamw"), 0)
    assert predicted == held < adamw


@pytest.mark.parametrize(
    "adamw_params", [["tok_embeddings", "output", "bias", "wo"], ["tok_embeddings", "output", "layers.1."]]
)
def test_the_planner_takes_the_runs_own_adamw_params(adamw_params: list[str]) -> None:
    """optim.adamw_params leaves more matrices to AdamW (two moments and a step each, not one
    momentum buffer); the planner split by Muon's default (this model with wo to AdamW: 112,412
    bytes of optimizer state predicted against the 120,612 held). Also a substring naming one block."""
    from trainer.compose import compose
    from trainer.config import validate
    from trainer.planning import planner_inputs

    cfg = compose("pretrain", ["model=nano", "optim=muon", f"optim.adamw_params=[{','.join(adamw_params)}]"])
    run = validate(cfg)
    shape, layout, work = planner_inputs(cfg, run)
    assert work.adamw_params == tuple(adamw_params)
    model = _model()
    optimizer = build_optimizer(model, run.optimizer, weight_decay=WD)
    _train(model, optimizer, range(1))
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values())
    assert state_bytes(ModelShape.from_model(model), layout, work, 0)[2] == held


def test_bad_settings_are_refused_before_launch() -> None:
    assert "use match_rms_adamw or original" in optimizer_problem(functools.partial(Muon, scale="spectral"))
    assert "use bfloat16 or float32" in optimizer_problem(functools.partial(Muon, ns_dtype="fp8"))
    assert "optim.momentum=-0.9 must be >= 0" in optimizer_problem(functools.partial(Muon, momentum=-0.9))
    # accepted before: beta2 = 1 made the weights NaN at the first step, momentum = 1 froze the matrices
    assert "optim.betas=(0.9, 1.0) must be below 1" in optimizer_problem(functools.partial(Muon, betas=(0.9, 1.0)))
    assert "optim.momentum=1.0 must be below 1" in optimizer_problem(functools.partial(Muon, momentum=1.0))


def test_the_launch_says_which_share_of_a_moe_muon_takes() -> None:
    """A mixture of experts' stacked 3-D expert weights take AdamW under optim=muon (a fresh
    reviewer: 21% of moe_tiny's parameters took Muon, said nowhere): the launch line gives the shares,
    from the model's shape; a dense model and another optimizer print nothing."""
    from trainer.compose import compose
    from trainer.config import validate

    def line(*overrides: str) -> str | None:
        run = validate(compose("pretrain", list(overrides)))
        return launch_line(run.optimizer, [(p.name, p.shape) for p in run.shape.params])

    moe = line("model=moe_tiny", "optim=muon")
    assert (
        moe is not None
        and moe.startswith("optim=muon: Muon takes the 2-D matrices (")
        and "3-D expert weights (" in moe
    )
    shape = validate(compose("pretrain", ["model=moe_tiny"])).shape
    total = sum(math.prod(p.shape) for p in shape.params)
    muon = sum(math.prod(p.shape) for p in shape.params if takes_muon(p.name, len(p.shape)))
    assert f"({100 * muon / total:.0f}% of the parameters)" in moe
    assert line("model=nano", "optim=muon") is None and line("model=moe_tiny") is None


def test_the_launch_says_muon_takes_the_lora_adapters() -> None:
    """optim=muon with LoRA orthogonalised the rank-8 adapters without a word (a new user's walkthrough)."""
    from trainer.compose import compose
    from trainer.config import validate

    run = validate(compose("pretrain", ["model=nano", "optim=muon", "+strategy/lora=default"]), for_launch=False)
    said = launch_line(run.optimizer, [(p.name, p.shape) for p in run.shape.params], adapters=run.adapters)
    assert said is not None and said.startswith("optim=muon with strategy.lora: the adapters are what trains"), said
    assert launch_line(run.optimizer, [], adapters=False) is None  # a dense model: nothing to say
