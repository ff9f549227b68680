"""strategy.float8 (`strategies.float8`): plait's float8 Linear against a reference written here
(scales ``finfo.max / amax``, float8 casts, the product of the dequantized values in fp32) and against
torchao's own scaled-matmul kernel path, which the layers it keeps in high precision, and validate's
refusals (the device, the layout, the all-gather of rowwise scales)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from strategies.float8 import Float8, apply_float8
from strategies.mesh import build_strategy
from strategies.planner.layout import workload_of
from trainer.compose import compose
from trainer.config import ConfigError, validate

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CPU_MESHES = SimpleNamespace(device=torch.device("cpu"), fsdp=SimpleNamespace(shape=(1,)))


def cast(x: torch.Tensor, dtype: torch.dtype, *, dim: int | None = None, pow2: bool = False):
    """``(float8 values, scale)`` of ``x``: one scale per tensor (dim None) or per slice along
    ``dim`` (amax over ``dim``), ``finfo.max / amax`` (rounded down to a power of 2 if ``pow2``)."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fmax = torch.finfo(dtype).max
    return (x * scale).clamp(-fmax, fmax).to(dtype), scale


def dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() / scale


def reference_forward(x_mk: torch.Tensor, w_nk: torch.Tensor, recipe: str) -> torch.Tensor:
    """Tensorwise: one e4m3 scale for the input and one for the weight; rowwise: one per input row
    and one per weight row (output feature), powers of 2. The matmul in fp32."""
    rowwise = recipe == "rowwise"
    x8, sx = cast(x_mk, E4M3, dim=-1 if rowwise else None, pow2=rowwise)
    w8, sw = cast(w_nk, E4M3, dim=-1 if rowwise else None, pow2=rowwise)
    return dequantized(x8, sx) @ dequantized(w8, sw).t()


def reference_grads(x_mk: torch.Tensor, w_nk: torch.Tensor, go_mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise backward: the output gradient in e5m2 (one scale), input and weight in e4m3."""
    x8, sx = cast(x_mk, E4M3)
    w8, sw = cast(w_nk, E4M3)
    go8, sgo = cast(go_mn, E5M2)
    grad_x = dequantized(go8, sgo) @ dequantized(w8, sw)
    grad_w = dequantized(go8, sgo).t() @ dequantized(x8, sx)
    return grad_x, grad_w


def one_linear(in_dim: int = 64, out_dim: int = 48) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(in_dim, out_dim, bias=False))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_plaits_float8_linear_equals_the_reference_and_torchaos_scaled_mm(recipe: str) -> None:
    model = one_linear()
    plain = copy.deepcopy(model)
    kernel = copy.deepcopy(model)
    assert Float8(recipe=recipe).apply(model, CPU_MESHES) == ["0"]  # emulated: meshes.device is CPU
    assert model[0].config.emulate
    # torchao's own path: its float8 cast and torch._scaled_mm (which CPU builds of torch run).
    apply_float8(kernel, recipe=recipe, emulate=False)
    x = torch.randn(2, 8, 64) * 3
    out = model(x)
    expected = reference_forward(x.reshape(-1, 64), model[0].weight.detach(), recipe).reshape(2, 8, 48)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Rowwise, torchao's kernel path rounds the product to bf16 (torch._scaled_mm has no fp32 output
    # for rowwise scales): equal to the reference within bf16's precision.
    rtol = 1e-5 if recipe == "tensorwise" else 2**-8
    torch.testing.assert_close(kernel(x), expected, rtol=rtol, atol=1e-5)
    # float8 is far from fp32: the comparison above could not pass on the unconverted layer.
    assert (plain(x) - expected).abs().max() > 100 * 1e-5


def test_power_of_2_scales_reach_torchaos_layer_and_the_cast() -> None:
    """``round_scales_to_power_of_2=true`` (what tensor parallelism needs with tensorwise): the
    forward equals the reference with both scales rounded down to powers of 2, and differs from
    the unrounded one; the float8 all-gather, which computes its own unrounded scales, is refused
    by `apply_float8` and turned off by the plugin's automatic choice on a sharded layout."""
    model = one_linear()
    Float8(recipe="tensorwise", round_scales_to_power_of_2=True).apply(model, CPU_MESHES)
    assert model[0].config.round_scales_to_power_of_2
    x = torch.randn(2, 8, 64) * 3
    x8, sx = cast(x.reshape(-1, 64), E4M3, pow2=True)
    w8, sw = cast(model[0].weight.detach(), E4M3, pow2=True)
    expected = (dequantized(x8, sx) @ dequantized(w8, sw).t()).reshape(2, 8, 48)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    unrounded = reference_forward(x.reshape(-1, 64), model[0].weight.detach(), "tensorwise").reshape(2, 8, 48)
    assert (model(x) - unrounded).abs().max() > 100 * 1e-5
    with pytest.raises(ValueError, match="not rounded to powers of 2"):
        apply_float8(one_linear(), recipe="tensorwise", fsdp_float8_all_gather=True, round_scales_to_power_of_2=True)
    sharded = SimpleNamespace(device=torch.device("cpu"), fsdp=SimpleNamespace(shape=(2,)))
    for pow2, all_gather in [(None, True), (True, False)]:
        plugin = Float8(recipe="tensorwise", round_scales_to_power_of_2=pow2)
        plugin.apply(one_linear(), sharded)
        assert plugin._all_gather is all_gather


def test_the_float8_backward_casts_the_output_gradient_to_e5m2() -> None:
    model = one_linear()
    Float8(recipe="tensorwise").apply(model, CPU_MESHES)
    x = (torch.randn(16, 64) * 2).requires_grad_(True)
    go = torch.randn(16, 48)
    model(x).backward(go)
    grad_x, grad_w = reference_grads(x.detach(), model[0].weight.detach(), go)
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[0].weight.grad, grad_w, rtol=1e-5, atol=1e-5)


def mixed_layers() -> nn.ModuleDict:
    model = nn.ModuleDict(
        {
            "block": nn.ModuleDict({"wq": nn.Linear(64, 64), "odd": nn.Linear(64, 40), "router": nn.Linear(64, 16)}),
            "moe": nn.ModuleDict({"router": nn.ModuleDict({"gate": nn.Linear(64, 16)})}),
            "embed": nn.Embedding(32, 64),
            "tied": nn.Linear(64, 32, bias=False),
            "output": nn.Linear(64, 32),
        }
    )
    model["tied"].weight = model["embed"].weight
    return model


def test_the_head_the_routers_small_and_tied_layers_stay_in_high_precision() -> None:
    model = mixed_layers()
    converted = Float8(recipe="tensorwise").apply(model, CPU_MESHES)
    # "block.router" is a Linear of its own name, not a module under a router: converted.
    assert converted == ["block.wq", "block.router"]
    assert type(model["output"]) is nn.Linear and type(model["moe"]["router"]["gate"]) is nn.Linear
    assert model["tied"].weight is model["embed"].weight
    # The patterns replace the defaults: the head and the router convert; 40 and tied never do.
    patterns = ["block.*"]
    assert Float8(recipe="rowwise", keep_high_precision=patterns).apply(mixed_layers(), CPU_MESHES) == [
        "moe.router.gate",
        "output",
    ]


def refusals(*overrides: str) -> str:
    with pytest.raises(ConfigError) as raised:
        validate(compose("pretrain", list(overrides)))
    return str(raised.value)


def test_validate_refuses_what_float8_cannot_run_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusals(
        "strategy.float8.recipe=rowwise",
        "strategy.float8.fsdp_float8_all_gather=true",
        "strategy.float8.emulate=false",
        "strategy=tp",
        "trainer.devices=2",
    )
    assert "fsdp_float8_all_gather=true needs one unrounded scale per weight (recipe=rowwise has one" in message
    assert "use strategy.float8.fsdp_float8_all_gather=null" in message
    assert "strategy.float8.emulate=false needs a CUDA GPU" in message
    tp2, pow2 = ("strategy=tp", "trainer.devices=2"), "strategy.float8.round_scales_to_power_of_2=true"
    # Tensor parallelism needs power-of-2 scales (tests/dist/test_float8_tp.py): rowwise has them.
    validate(compose("pretrain", ["strategy.float8.recipe=rowwise", *tp2]))
    validate(compose("pretrain", ["strategy.float8.recipe=tensorwise", pow2, *tp2]))
    tensorwise_tp = refusals("strategy.float8.recipe=tensorwise", *tp2)
    assert "strategy.float8.recipe=tensorwise with tensor parallelism (strategy.tp=2) needs power-of-2" in tensorwise_tp
    assert "use strategy.float8.round_scales_to_power_of_2=true or strategy.float8.recipe=rowwise" in tensorwise_tp
    unrounded_rowwise = refusals(
        "strategy.float8.recipe=rowwise", "strategy.float8.round_scales_to_power_of_2=false", *tp2
    )
    assert "use strategy.float8.round_scales_to_power_of_2=null" in unrounded_rowwise
    # The all-gather's scales are torchao's own, unrounded: refused with power-of-2 scales or TP,
    # each time naming the one fix that runs (no loop between two refusals).
    gather = "strategy.float8.fsdp_float8_all_gather=true"
    for overrides, why in [
        ((pow2, "strategy=fsdp", "trainer.devices=2"), "not rounded to powers of 2 as set"),
        (("strategy=fsdp_tp", "trainer.devices=4"), "tensor parallelism (strategy.tp=2) needs power-of-2 scales"),
    ]:
        problems = str(refusals("strategy.float8.recipe=tensorwise", gather, *overrides)).split("\n  - ")[1:]
        assert len(problems) == 1 and why in problems[0], problems
        assert "use strategy.float8.fsdp_float8_all_gather=null" in problems[0]
    validate(compose("pretrain", ["strategy.float8.recipe=tensorwise", pow2, "strategy=fsdp_tp", "trainer.devices=4"]))
    # Where FSDP shards nothing, an explicit all-gather was accepted and silently off (a reviewer: ddp on 2 ranks).
    problems = str(refusals("strategy.float8.recipe=tensorwise", gather, "strategy=ddp", "trainer.devices=2"))
    assert "fsdp_float8_all_gather=true, but FSDP shards no weight in this layout (strategy.dp_shard=1" in problems
    validate(compose("pretrain", ["strategy.float8.recipe=tensorwise", gather, "strategy=fsdp", "trainer.devices=2"]))
    # Context parallelism: tensorwise scales each rank's part of the sequence on its own; rowwise
    # scales each token row, as one process does.
    cp2 = ("strategy=cp", "trainer.devices=2")
    assert "use strategy.float8.recipe=rowwise" in refusals("strategy.float8.recipe=tensorwise", *cp2)
    validate(compose("pretrain", ["strategy.float8.recipe=rowwise", *cp2]))
    assert "strategy.float8.recipe='bf8' must be one of tensorwise, rowwise or null" in refusals(
        "strategy.float8.recipe=bf8"
    )
    # A GPU without float8 tensor cores (an A100 is SM 8.0).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    plugin = Float8(recipe="tensorwise", accelerator="gpu")
    run = SimpleNamespace(
        dims=SimpleNamespace(tp=1, cp=1),
        micro_batch_size=1,
        seq_len=256,
        drop_last=True,
        row_kind="tokens",
        adapters=False,
    )
    (problem,) = plugin.problems(run, None)
    assert "SM 8.9+" in problem and "this GPU is SM 8.0" in problem and "strategy.float8.recipe=null" in problem
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert plugin.problems(run, None) == []


def test_validate_refuses_dims_the_gpus_float8_gemm_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (not emulated) torch._scaled_mm takes inner and output dims that are multiples of 16:
    a layer tensor parallelism splits below that, and a forward's tokens, are refused naming the fix;
    emulated (CPU) runs take any dims."""
    rowwise = "strategy.float8.recipe=rowwise"
    # 4 heads of 24, 2 kv heads: wk and wv are [48, 96], 24 rows each on 2 tp ranks.
    small = [rowwise, "model.dim=96", "model.n_heads=4", "model.n_kv_heads=2"]
    tp2 = validate(compose("pretrain", [*small, "strategy=tp", "trainer.devices=2"]))
    one_rank = validate(compose("pretrain", small))
    fixed = "strategy.float8.keep_high_precision=[output,*.router.*,layers.*.attention.wk,layers.*.attention.wv]"
    rows = [rowwise, "data.seq_len=40"]  # one forward: 3 rows of 40 tokens (120) or 4 (160)

    def run_of(*overrides: str):
        return validate(compose("pretrain", [*rows, *overrides]))

    odd = run_of("train.micro_batch_size=3", "train.global_batch_size=6", "data.drop_last=true")
    even = run_of("train.micro_batch_size=4", "train.global_batch_size=8", "data.drop_last=true")
    partial = run_of("train.micro_batch_size=4", "train.global_batch_size=8", "data.drop_last=false")
    pp2 = run_of(
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "data.drop_last=true",
        "strategy=pp",
        "trainer.devices=2",
    )  # each pipeline micro-batch holds 2 rows: 80 tokens
    cp2 = run_of(
        "data.seq_len=96",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "data.drop_last=true",
        "strategy=cp",
        "trainer.devices=2",
    )  # 96 / 2 = 48 tokens a rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    gpu = Float8(recipe="rowwise", accelerator="gpu")
    (problem,) = gpu.problems(tp2, tp2.shape)
    assert "layers.*.attention.wk [24, 96], layers.*.attention.wv [24, 96];" in problem, problem
    assert f"keep_high_precision='[{fixed.split('=[')[1]}'" in problem, problem
    # validate on a GPU refuses it, and accepts the fix it names as a user passes it; emulated, and on
    # one rank, nothing to refuse.
    on_gpu = [*small, "strategy=tp", "trainer.devices=2", "trainer.accelerator=gpu"]
    assert problem in refusals(*on_gpu)
    validate(compose("pretrain", [*on_gpu, fixed]))
    assert Float8(recipe="rowwise", accelerator="gpu", emulate=True).problems(tp2, tp2.shape) == []
    assert gpu.problems(one_rank, one_rank.shape) == []
    (problem,) = gpu.problems(odd, odd.shape)
    assert "3 rows x data.seq_len=40 = 120; use a data.seq_len that is a multiple of 16" in problem, problem
    assert gpu.problems(even, even.shape) == [] == gpu.problems(pp2, pp2.shape) == gpu.problems(cp2, cp2.shape)
    (problem,) = gpu.problems(partial, partial.shape)
    assert "1 row (data.drop_last=false: a last, partial batch" in problem and "or data.drop_last=true" in problem
    # Nothing converted (every Linear kept in high precision): no GEMM to refuse, but a float8 run that
    # converts nothing is (it trained in high precision without a word: a new user's walkthrough).
    (problem,) = Float8(recipe="rowwise", accelerator="gpu", keep_high_precision=["*"]).problems(odd, odd.shape)
    assert problem.startswith("strategy.float8.recipe=rowwise converts no Linear layer of this model"), problem
    with pytest.raises(ConfigError, match=r"converts no Linear layer .* or strategy\.float8\.recipe=null"):
        validate(compose("pretrain", ["model=nano", "model.dim=24", "model.n_heads=2", "model.n_kv_heads=1",
                                      "strategy.float8.recipe=tensorwise"]))  # fmt: skip


def test_the_planner_times_the_float8_setting_and_keeps_the_what_if() -> None:
    def workload_float8(recipe: str, what_if: bool) -> bool:
        cfg = compose("pretrain", [f"strategy.float8.recipe={recipe}"])
        run = validate(cfg)
        return workload_of(run, build_strategy(cfg.strategy, run=run), float8=what_if).float8

    assert workload_float8("tensorwise", what_if=False)
    assert not workload_float8("null", what_if=False) and workload_float8("null", what_if=True)


def test_a_keep_high_precision_pattern_that_matches_no_layer_is_refused() -> None:
    """keep_high_precision=[output,wo] left both wo layers in float8 without a word (whole-name globs;
    LoRA's target_modules take a bare suffix, so a user writes it so)."""
    message = refusals("strategy.float8.recipe=tensorwise", "strategy.float8.keep_high_precision=[output,wo]")
    assert "'wo' matches no Linear layer of this model" in message and "'*.wo'" in message
    validate(
        compose(
            "pretrain", ["strategy.float8.recipe=tensorwise", "strategy.float8.keep_high_precision=[output,'*.wo']"]
        )
    )
