"""PAFT merges: exact one-delta task arithmetic (also through `plait merge`), TIES by hand, DARE, sparsity."""

import torch
from omegaconf import OmegaConf

from trainer.merge import main as merge_main
from trainer.merge import merge_states, sparsity, ties_delta, trim


def test_one_delta_at_weight_one_is_the_fine_tuned_model_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(64, 64, generator=g), "tiny": torch.tensor([1.0, 1e-20, 3e10])}
    tuned = {"w": base["w"] + 1e-3 * torch.randn(64, 64, generator=g), "tiny": torch.tensor([1e-20, 1.0, -7.0])}
    merged = merge_states(base, [tuned], method="task_arithmetic")
    assert all(torch.equal(merged[k], tuned[k]) for k in base)
    # base + (tuned - base) in fp32 is not exact: the test would catch that formula.
    assert not torch.equal(base["tiny"] + (tuned["tiny"] - base["tiny"]), tuned["tiny"])


def test_ties_three_parameter_hand_example():
    # Trim to 2 of 3 entries each: [.5,-.2,0], [-.3,-.4,0], [0,.3,-.6]; elected signs of the sum
    # [.2,-.3,-.6]: + - -; disjoint means: .5, (-.2-.4)/2 = -.3, -.6.
    f64 = {"dtype": torch.float64}
    deltas = [
        torch.tensor([0.5, -0.2, 0.1], **f64),
        torch.tensor([-0.3, -0.4, 0.05], **f64),
        torch.tensor([0.1, 0.3, -0.6], **f64),
    ]
    assert trim(deltas[0], 2 / 3).tolist() == [0.5, -0.2, 0.0]
    torch.testing.assert_close(
        ties_delta(deltas, density=2 / 3), torch.tensor([0.5, -0.3, -0.6], **f64), rtol=0, atol=1e-12
    )
    base = {"p": torch.tensor([1.0, 2.0, 3.0])}
    merged = merge_states(base, [{"p": base["p"] + d} for d in deltas], method="ties", density=2 / 3)
    torch.testing.assert_close(merged["p"], torch.tensor([1.5, 1.7, 2.4]), rtol=0, atol=1e-6)


def test_dare_keeps_the_delta_in_expectation_and_zero_drop_is_task_arithmetic():
    base, tuned = {"p": torch.zeros(20000)}, {"p": torch.full((20000,), 0.5)}
    merged = merge_states(base, [tuned], method="dare", drop=0.9, seed=1)
    kept = merged["p"] != 0
    assert 0.08 < kept.float().mean() < 0.12 and torch.allclose(merged["p"][kept], torch.tensor(5.0))
    assert abs(merged["p"].mean().item() - 0.5) < 0.05
    assert torch.equal(merge_states(base, [tuned], method="dare", drop=0.0)["p"], tuned["p"])


def test_sparsity_counts_unchanged_entries():
    base, tuned = {"p": torch.zeros(4)}, {"p": torch.tensor([0.0, 1e-8, 0.5, 0.0])}
    assert sparsity(base, tuned, tol=1e-6) == {"zero": 0.5, "abs_le_1e-06": 0.75}


def _fake_run(path, state, cfg):
    import torch.distributed.checkpoint as dcp

    from strategies.checkpoint.dcp import seal

    ckpt = path / "checkpoints" / "last"
    ckpt.mkdir(parents=True)
    OmegaConf.save(cfg, path / "config.yaml")
    dcp.save({"model": state}, checkpoint_id=ckpt)
    torch.save({}, ckpt / "meta.pt")
    seal(ckpt)  # its manifest: a checkpoint is complete only with one


def test_plait_merge_command_one_delta_reproduces_the_run(tmp_path, capsys):
    from strategies.checkpoint.dcp import load_model_weights
    from trainer.model_node import instantiate_model

    cfg = OmegaConf.create(
        {
            "model": {
                "_target_": "trainer.models.llama.Llama",
                "dim": 32,
                "n_layers": 1,
                "n_heads": 2,
                "n_kv_heads": 2,
                "max_seq_len": 16,
                "vocab_size": 40,
            }
        }
    )
    torch.manual_seed(0)
    base, tuned = instantiate_model(cfg.model), instantiate_model(cfg.model)
    _fake_run(tmp_path / "base", base.state_dict(), cfg)
    from_base = OmegaConf.merge(cfg, {"model": {"init_from": str(tmp_path / "base" / "checkpoints" / "last")}})
    _fake_run(tmp_path / "tuned", tuned.state_dict(), from_base)
    merge_main(
        [
            f"base={tmp_path / 'base'}",
            f"deltas=[{tmp_path / 'tuned'}]",
            "method=task_arithmetic",
            f"out={tmp_path / 'out'}",
        ]
    )
    assert "delta" in capsys.readouterr().out
    merged = instantiate_model(cfg.model)
    load_model_weights(tmp_path / "out" / "checkpoints" / "last", merged)
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), tuned.state_dict().values()))


def test_plait_merge_without_deltas_is_refused_before_loading(capsys):
    import pytest

    with pytest.raises(SystemExit) as exited:
        merge_main(["base=no_such_run", "deltas=[]"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(
        "plait: error: deltas=[] names no fine-tuned run to merge; give at least one"
    )


def test_a_delta_fine_tuned_from_another_base_is_refused(tmp_path, capsys):
    """A plait run among the deltas records its model.init_from: one that names another run (or
    none: trained from scratch) is not a fine-tune of the base, and its difference would be merged as one."""
    import pytest

    from trainer.model_node import instantiate_model

    cfg = OmegaConf.create(
        {"model": {"_target_": "trainer.models.llama.Llama", "dim": 16, "n_layers": 1, "n_heads": 2, "vocab_size": 40}}
    )
    model = instantiate_model(cfg.model)
    _fake_run(tmp_path / "base", model.state_dict(), cfg)
    _fake_run(tmp_path / "other", model.state_dict(), cfg)
    _fake_run(
        tmp_path / "good", model.state_dict(), OmegaConf.merge(cfg, {"model": {"init_from": str(tmp_path / "base")}})
    )
    _fake_run(
        tmp_path / "bad", model.state_dict(), OmegaConf.merge(cfg, {"model": {"init_from": str(tmp_path / "other")}})
    )
    # recorded as typed by a run before paths were made absolute: relative to where it started, not checked
    _fake_run(tmp_path / "old", model.state_dict(), OmegaConf.merge(cfg, {"model": {"init_from": "runs/base"}}))
    deltas = ",".join(str(tmp_path / d) for d in ("good", "bad", "other", "old"))
    with pytest.raises(SystemExit) as exited:
        merge_main([f"base={tmp_path / 'base'}", f"deltas=[{deltas}]", f"out={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and not (tmp_path / "out").exists()
    assert f"deltas: {tmp_path / 'bad'} was trained model.init_from={tmp_path / 'other'}, not from base=" in err
    assert f"deltas: {tmp_path / 'other'} was trained from scratch (no model.init_from)" in err
    assert f"{tmp_path / 'good'} was" not in err and f"{tmp_path / 'old'} was" not in err


def test_a_hugging_face_base_merges_into_a_run_generate_can_load(tmp_path):
    """base= a Hugging Face directory has no config.yaml: the merged run takes the fine-tuned run's
    (model=hf from that base), tokenizer and chat template, so load_run_model (plait generate,
    export) builds it; its weights are the merge's."""
    from hf_checkpoints import make_hf_dir

    from trainer.run_model import HF_BUILDER, load_run_model

    hf = tmp_path / "hf"
    make_hf_dir("llama3", hf)
    base = load_run_model(hf).model.state_dict()
    tuned = {k: v + 0.01 for k, v in base.items()}
    cfg = OmegaConf.create({"model": {"_target_": HF_BUILDER, "init_from": str(hf)}})
    _fake_run(tmp_path / "sft", tuned, cfg)
    (tmp_path / "sft" / "tokenizer.json").write_bytes((hf / "tokenizer.json").read_bytes())
    merge_main([f"base={hf}", f"deltas=[{tmp_path / 'sft'}]", "method=task_arithmetic", f"out={tmp_path / 'out'}"])
    assert (tmp_path / "out" / "config.yaml").read_text() == (tmp_path / "sft" / "config.yaml").read_text()
    merged = load_run_model(tmp_path / "out")
    assert merged.tokenizer is not None
    assert all(torch.equal(merged.model.state_dict()[k], v) for k, v in tuned.items())


def test_ties_divides_by_the_magnitude_of_negative_weights():
    """A negative weight negates its delta (as in task arithmetic); TIES's disjoint mean divided by the
    signed sum of the agreeing weights, so [1, -1] gave 0 where both weighted deltas were +1 (a
    reviewer). Mutation: ``count`` from the signed weights -> [0, -2]."""
    deltas = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([-1.0, -2.0], dtype=torch.float64)]
    merged = ties_delta(deltas, density=1.0, weights=[1.0, -1.0])
    assert merged.tolist() == [1.0, 2.0]  # weighted deltas [1, 0] and [1, 2]: means 1 and 2


def test_plait_merge_refuses_an_out_that_holds_a_training_run(tmp_path, capsys):
    """``out=`` a training run raised ``OSError: Cannot call rmtree on a symbolic link`` (its ``last``
    link; a reviewer); it is refused before anything loads, and nothing there is touched."""
    import pytest

    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000004").mkdir(parents=True)
    (run / "checkpoints" / "last").symlink_to("step_0000004")
    with pytest.raises(SystemExit) as exited:
        merge_main(["base=no_such_run", "deltas=[no_such_arm]", f"out={run}"])
    assert exited.value.code == 2
    assert f"out={run} holds a training run's checkpoints; choose a new directory" in capsys.readouterr().err
    assert (run / "checkpoints" / "last").is_symlink() and (run / "checkpoints" / "step_0000004").is_dir()


def test_a_lora_arm_merges_as_its_adapters_folded_into_its_base(tmp_path):
    """``plait merge`` refused every LoRA arm ("holds LoRA adapters ... export the run first"), though
    fine-tuning.md describes the check of a LoRA arm's recorded base (a reviewer). The arm's adapters
    are folded into the base it recorded: one arm at weight 1 gives base + (alpha / r) B A in every
    adapted layer and the base elsewhere, computed here from the adapters' own tensors.
    Mutation: `_load` without load_base -> the refusal."""
    from harness import plait

    from trainer.init_from import load_init_from
    from trainer.run_model import load_run_model

    small = [
        "model=nano",
        "trainer.max_steps=1",
        "logger=none",
        "~callbacks.plots",
        "trainer.enable_progress_bar=false",
    ]
    sources = ["data=synthetic", *(f"data.sources.{s}.{k}={v}" for s in ("reversal", "sorting", "addition") for k, v in (("limit", 16), ("val_size", 4), ("metric", "loss")))]  # fmt: skip
    for name, extra in (("base", []), ("arm", [f"model.init_from={tmp_path / 'base'}", "+strategy/lora=default"])):
        result = plait("sft", *small, *sources, *extra, "optim.lr=1e-2", f"run_dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
    merge_main(
        [
            f"base={tmp_path / 'base'}",
            f"deltas=[{tmp_path / 'arm'}]",
            "method=task_arithmetic",
            f"out={tmp_path / 'out'}",
        ]
    )
    base = load_run_model(tmp_path / "base").model.state_dict()
    arm = load_run_model(tmp_path / "arm", load_base=load_init_from).model
    merged = load_run_model(tmp_path / "out").model.state_dict()
    adapted = {name for name, m in arm.named_modules() if hasattr(m, "lora_A")}
    assert adapted and any(float(m.lora_B.weight.abs().max()) > 0 for n, m in arm.named_modules() if n in adapted)
    for name, weight in base.items():
        layer = name.removesuffix(".weight")
        if layer in adapted:
            module = arm.get_submodule(layer)
            delta = module.lora_scaling * module.lora_B.weight.double() @ module.lora_A.weight.double()
            torch.testing.assert_close(merged[name].double(), weight.double() + delta, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(merged[name], weight), name
