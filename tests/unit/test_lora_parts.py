"""LoRA's pieces on one process: which layers it adapts, what it freezes, the merge, and the
layouts validate refuses (before any process starts)."""

from __future__ import annotations

import pytest
import torch
from harness import compose_config

from strategies.transforms.lora import apply_lora, merge_lora, trainable_bytes
from strategies.transforms.lora_targets import is_adapter
from trainer.config import ConfigError, validate
from trainer.models.llama import Llama


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)


def test_adapters_start_at_the_base_and_merge_into_it() -> None:
    model, ids = _model(), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids)
    names = apply_lora(model, rank=4, alpha=8.0, target_modules=["wq", "layers.1.feed_forward.*"])
    assert names == [
        "layers.0.attention.wq",
        "layers.1.attention.wq",
        "layers.1.feed_forward.w1",
        "layers.1.feed_forward.w3",
        "layers.1.feed_forward.w2",
    ]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{k}.weight" for n in names for k in "AB"} and all(map(is_adapter, trainable))
    assert trainable_bytes(model)[0] == 4 * sum(
        4 * (m.in_features + m.out_features) for m in map(model.get_submodule, names)
    )
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)  # B = 0
        for name in names:
            model.get_submodule(name).lora_B.weight.normal_(std=0.1)
        adapted = model(ids)
        wq = model.layers["0"].attention.wq
        expected = wq.weight + 2.0 * wq.lora_B.weight @ wq.lora_A.weight
    assert (adapted - before).abs().max() > 1e-3
    assert merge_lora(model) == len(names)
    assert not any(is_adapter(n) for n, _ in model.named_parameters())
    torch.testing.assert_close(wq.weight, expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)


def test_no_matching_layer_names_the_model_layers() -> None:
    with pytest.raises(ValueError) as err:
        apply_lora(_model(), rank=4, alpha=8.0, target_modules=["qproj"])
    assert "matches no linear layer; the model has ['output', 'w1'" in str(err.value)
    assert "(Hugging Face/PEFT names: ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj'" in str(
        err.value
    )


@pytest.mark.parametrize(
    ("peft", "plait"),
    [
        (["q_proj", "v_proj"], ["wq", "wv"]),
        (["gate_proj", "up_proj", "down_proj", "lm_head"], ["w1", "w3", "w2", "output"]),
        (["model.layers.1.self_attn.o_proj", "self_attn.k_proj"], ["layers.1.attention.wo", "wk"]),
        (["model.layers.0.mlp.*"], ["layers.0.feed_forward.*"]),
    ],
)
def test_peft_names_select_the_layers_plait_names_do(peft, plait) -> None:
    """``target_modules`` as PEFT users write them (transformers' module names) adapt the same
    layers as plait's names: the adapted model computes the same logits."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = []
    for patterns in (peft, plait):
        model = _model()
        names = apply_lora(model, rank=4, alpha=8.0, target_modules=patterns)
        with torch.no_grad():
            for name in names:
                model.get_submodule(name).lora_B.weight.normal_(std=0.1, generator=torch.Generator().manual_seed(2))
            logits.append((names, model(ids)))
    assert logits[0][0] == logits[1][0]
    torch.testing.assert_close(logits[0][1], logits[1][1], rtol=0, atol=0)


def test_every_pattern_must_select_a_layer() -> None:
    """A dead pattern beside live ones (another model's name, a glob missing its ``layers.`` prefix)
    is an error naming it, not a run that adapts fewer layers than asked."""
    model = _model()
    with pytest.raises(ValueError) as err:
        apply_lora(model, rank=4, alpha=8.0, target_modules=["wq", "q_prj", "attention.*"])
    assert "target_modules: 'q_prj', 'attention.*' match no linear layer; the model has ['output'" in str(err.value)
    assert not any(is_adapter(n) for n, _ in model.named_parameters())


def test_merging_into_a_tied_head_is_refused_and_changes_nothing() -> None:
    """The head's weight is the embedding's: folding B A into it would change the input embedding
    too, so the merged model would differ from the adapted one."""
    torch.manual_seed(0)
    model = Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16, tie_embeddings=True)
    apply_lora(model, rank=4, alpha=8.0, target_modules=["wq", "output"])
    with torch.no_grad():
        model.output.lora_B.weight.normal_(std=0.1)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="output share their weight with another layer"):
        merge_lora(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ([], "strategy.lora trains adapters on a frozen base"),
        (
            ["strategy=pp", "trainer.devices=2", "train.micro_batch_size=1"],
            "strategy.lora does not compose with pipeline parallelism",
        ),
        (["strategy=tp", "trainer.devices=2", "strategy.lora.dropout=0.1"], "use strategy.lora.dropout=0"),
        (["strategy=diloco", "trainer.devices=2"], "strategy.lora does not compose with strategy.local_sgd"),
        (["strategy.lora.rank=0"], "strategy.lora.rank=0 must be >= 1"),
        (["strategy=tp", "trainer.devices=2", "strategy.lora.quantize=nf4"], "use strategy.tp=1 (FSDP2 shards them"),
        (
            ["strategy.lora.target_modules=[wq,query]"],
            "'query' matches no linear layer; the model has ['output', 'w1'",
        ),
        (
            ["model.tie_embeddings=true", "strategy.lora.target_modules=[wq,output]"],
            "leave 'output' out of strategy.lora",
        ),
        (
            ["model.tie_embeddings=true", "strategy.lora.target_modules=[q_proj,lm_head]"],
            "leave 'output' out of strategy.lora",
        ),
    ],
)
def test_validate_refuses_what_lora_does_not_run(overrides, problem) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["+strategy/lora=default", *overrides]))
    assert any(problem in p for p in err.value.problems), err.value.problems


def test_a_lora_run_is_not_a_base(tmp_path) -> None:
    from omegaconf import OmegaConf

    from strategies.checkpoint.manifest import checkpoint_files, hash_files, write_manifest

    run = tmp_path / "lora_run"
    step = run / "checkpoints" / "step_0000001"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "meta.pt").write_bytes(b"")
    write_manifest(step, hash_files(step, checkpoint_files(step)))  # a finished save
    OmegaConf.save(compose_config(["+strategy/lora=default", "model.init_from=/some/base"]), run / "config.yaml")
    with pytest.raises(ConfigError) as err:
        validate(compose_config([f"model.init_from={run}"]))
    assert any(f"model.init_from={run} is a LoRA run" in p and "plait export" in p for p in err.value.problems), (
        err.value.problems
    )


def test_dropout_acts_on_the_adapter_input_in_training_only() -> None:
    model, ids = _model(), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    names = apply_lora(model, rank=4, alpha=8.0, dropout=0.5, target_modules=["wq"])
    with torch.no_grad():
        for name in names:
            model.get_submodule(name).lora_B.weight.normal_(std=0.1)
        model.eval()
        reference = model(ids)
        torch.testing.assert_close(model(ids), reference, rtol=0, atol=0)
        model.train()
        assert (model(ids) - reference).abs().max() > 1e-4


def _adapted(quantize: str | None) -> torch.nn.Linear:
    from strategies.transforms.lora import quantize_pending

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"w1": torch.nn.Linear(64, 48, bias=False)})
    apply_lora(model, rank=4, alpha=8.0, target_modules=["w1"], quantize=quantize)
    quantize_pending(model)
    with torch.no_grad():
        model["w1"].lora_B.weight.normal_(std=0.1)
    return model["w1"]


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_weight_reads_give_what_the_adapted_layer_computes(quantize) -> None:
    """`linear_slice` (SAT's sliced MLP) and `linear_operands` (the chunked head) against the layer's
    own forward (its base matmul, bitsandbytes' for NF4, plus the LoRA hook): the adapter and the
    4-bit base come along."""
    from strategies.transforms.lora import linear_operands, linear_slice

    layer = _adapted(quantize)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([0, 3, 7, 40])
    with torch.no_grad():
        full = layer(x)
        torch.testing.assert_close(linear_slice(layer, x, rows=rows), full[..., rows], rtol=1e-5, atol=1e-5)
        mask = torch.zeros(64).index_fill_(0, rows, 1.0)  # w2's sliced input: the other features are 0
        torch.testing.assert_close(linear_slice(layer, x[..., rows], cols=rows), layer(x * mask), rtol=1e-5, atol=1e-5)
        x2, w2 = linear_operands(layer, x)
        assert w2.shape == (48, 64 + 4)
        torch.testing.assert_close(x2 @ w2.T, full, rtol=1e-5, atol=1e-5)


def test_stacked_experts_named_by_the_targets_are_reported_unadapted() -> None:
    from strategies.transforms.lora_targets import unadaptable
    from trainer.models.moe_transformer import MoETransformer

    model = MoETransformer(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        ffn_dim=48,
        max_seq_len=16,
        num_experts=4,
        top_k=2,
        moe_ffn_dim=16,
        n_dense_layers=1,
    )
    names = apply_lora(model, rank=4, alpha=8.0)
    assert "layers.0.feed_forward.w1" in names and not any(".experts" in n for n in names)
    assert unadaptable(model, ["w1", "w2", "w3"]) == [f"layers.1.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]
    assert unadaptable(model, ["wq"]) == []


@pytest.mark.parametrize(
    "switch",
    [
        ["strategy.lora.rank=16"],
        ["strategy/lora=default", "strategy.lora.rank=16"],
        ["+strategy/lora=default", "strategy.lora.rank=16"],
    ],
)
def test_lora_switches_on_without_hydras_plus(switch) -> None:
    """``strategy.lora.rank=16`` (a LoRA setting, as PEFT users write it) and ``strategy/lora=default``
    select LoRA as ``+strategy/lora=default`` does (`trainer.compose.select_transforms`); validate
    then asks for the base, not for Hydra's syntax."""
    cfg = compose_config(["model=nano", *switch], recipe="sft", tiny=False)
    assert cfg.strategy.lora.rank == 16 and cfg.strategy.lora._target_ == "strategies.transforms.lora.LoRA"
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert any("set model.init_from=" in p for p in err.value.problems), err.value.problems


def test_a_recipe_that_lists_lora_keeps_hydras_rules(tmp_path) -> None:
    """A recipe with ``strategy/lora`` in its defaults list takes ``strategy/lora=...`` as Hydra does."""
    recipe = tmp_path / "my_lora.yaml"
    recipe.write_text("defaults:\n  - sft\n  - /strategy/lora@strategy.lora: default\n  - _self_\n")
    cfg = compose_config(
        ["model=nano", "strategy/lora=default", "strategy.lora.rank=4"], recipe=str(recipe), tiny=False
    )
    assert cfg.strategy.lora.rank == 4


def test_a_recipe_that_writes_lora_out_keeps_its_settings(tmp_path) -> None:
    """A recipe holding ``strategy.lora`` itself (a run's config.yaml under ``plait resume``) takes a LoRA
    field as a change of its own settings, not as a switch to the preset's (which reset the others)."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "defaults:\n  - sft\n  - _self_\nstrategy:\n  lora:\n    _target_: strategies.transforms.lora.LoRA\n"
        "    rank: 4\n    alpha: 3.0\n    target_modules: [wq]\n"
    )
    cfg = compose_config(["model=nano", "strategy.lora.rank=6"], recipe=str(recipe), tiny=False)
    assert (cfg.strategy.lora.rank, cfg.strategy.lora.alpha, list(cfg.strategy.lora.target_modules)) == (6, 3.0, ["wq"])


def test_a_plus_on_a_lora_field_still_switches_it_on() -> None:
    cfg = compose_config(["model=nano", "+strategy.lora.rank=16"], recipe="sft", tiny=False)
    assert cfg.strategy.lora.rank == 16
