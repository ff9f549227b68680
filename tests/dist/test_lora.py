"""LoRA (``+strategy/lora=default``) equals a plain one-process loop with its own LoRA layers, on one
process, FSDP2 and TP2 (gloo); the base stays bitwise unchanged; checkpoints hold only the adapters;
the export merges them (base + (alpha/r) B A) and writes a PEFT adapter that ``peft`` loads.

The base is a random Llama-3 Hugging Face directory (`hf_checkpoints.make_hf_dir`, loaded by
``model=hf model.init_from=<dir>``). The reference is written here: the Llama's forward with each
target projection wrapped in this file's `RefLoRA` (A drawn as the plugin documents it: one
``torch.Generator().manual_seed(seed)``, uniform(-1/sqrt(in), 1/sqrt(in)) per target in module
order; B zero), token-mean cross-entropy of the whole global batch, SGD with momentum on the
adapters only. B starts at zero, so the first step's A gradients are zero; the later steps test A.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from harness import compose_config, fit, losses, recorded
from hf_checkpoints import make_hf_dir
from omegaconf import OmegaConf
from torch import nn

from trainer.build import build_data

STEPS = 4
RANK, ALPHA = 4, 8.0
TOL = {"rtol": 1e-5, "atol": 1e-5}
TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
LAYOUTS = {
    "one_process": ["train.micro_batch_size=8"],
    "fsdp2": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"],
    "tp2": ["strategy=tp", "trainer.devices=2", "train.micro_batch_size=4"],  # sequence and loss parallel on
}
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    make_hf_dir("llama3", root / "hf")
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))}) for _ in range(400)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _overrides(root) -> list[str]:
    return [
        "model=hf", f"model.init_from={root / 'hf'}", f"data.path={root / 'docs.jsonl'}",
        "optim=sgd", "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=0",
        f"trainer.max_steps={STEPS}", "+strategy/lora=default", f"strategy.lora.rank={RANK}", f"strategy.lora.alpha={ALPHA}",
        "+callbacks.grads._target_=harness.GradRecorder", "+callbacks.params._target_=harness.ParamRecorder",
    ]  # fmt: skip


class RefLoRA(nn.Module):
    """y = base(x) + (alpha / r) (x A^T) B^T: the test's own adapter around a frozen linear layer."""

    def __init__(self, base: nn.Linear, a: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(torch.zeros(base.out_features, a.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (ALPHA / RANK) * (x @ self.A.T) @ self.B.T


def _reference(root) -> dict:
    from trainer.data.packing import IGNORE_INDEX
    from trainer.data.sampler import GlobalBatchSampler
    from trainer.model_node import instantiate_model
    from trainer.models.hf import load_hf_weights

    cfg = compose_config(_overrides(root))
    prepared = build_data(cfg).prepare()
    rows = prepared.train
    model = instantiate_model(cfg.model, vocab_size=prepared.tokenizer.vocab_size)
    load_hf_weights(model, root / "hf")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    adapters: dict[str, RefLoRA] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in TARGETS:
            bound = 1 / math.sqrt(module.in_features)
            a = torch.empty(RANK, module.in_features).uniform_(-bound, bound, generator=generator)
            parent, _, leaf = name.rpartition(".")
            adapters[name] = RefLoRA(module, a)
            setattr(model.get_submodule(parent), leaf, adapters[name])
    params = [p for m in adapters.values() for p in (m.A, m.B)]
    optimizer = torch.optim.SGD(params, lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    sampler = GlobalBatchSampler(
        len(rows), global_batch_size=8, dp_size=1, shuffle=cfg.data.shuffle, seed=cfg.data.seed
    )
    out = {"loss": [], "grads": [], "base": base}
    for _, index in zip(range(STEPS), sampler):
        labels = rows.labels[index]
        logits = model(
            rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
        )
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append(_plait_names({n: (m.A.grad.clone(), m.B.grad.clone()) for n, m in adapters.items()}))
        optimizer.step()
    out["adapters"] = _plait_names({n: (m.A.detach().clone(), m.B.detach().clone()) for n, m in adapters.items()})
    return out


def _plait_names(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{n}.lora_{k}.weight": t for n, (a, b) in pairs.items() for k, t in (("A", a), ("B", b))}


@pytest.fixture(scope="module")
def ref(base) -> dict:
    return _reference(base)


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        cfg = compose_config([*_overrides(base), *layout])
        run_dir = tmp_path_factory.mktemp(name)
        _, task = fit(cfg, run_dir)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)  # what `plait` writes, for the export
        shutil.copyfile(base / "hf" / "tokenizer.json", run_dir / "tokenizer.json")
        out[name] = {**recorded(task.history), "run_dir": run_dir}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_fit_equals_a_plain_loop_and_keeps_the_base(runs, ref, layout):
    run = runs[layout]
    torch.testing.assert_close(run["loss"], ref["loss"], **TOL, msg="losses")
    assert len(run["grads"]) == STEPS
    for step, (got, expected) in enumerate(zip(run["grads"], ref["grads"]), 1):
        assert set(got) == set(expected), "only the adapters have gradients"
        torch.testing.assert_close(got, expected, **TOL, msg=f"adapter gradients at step {step}")
    assert any(g.abs().sum() > 0 for n, g in run["grads"][-1].items() if "lora_A" in n), "A is trained"
    params = run["params"]
    for name, weight in ref["base"].items():
        assert torch.equal(params[name], weight), f"{name}: the base changed"
    torch.testing.assert_close({n: params[n] for n in ref["adapters"]}, ref["adapters"], **TOL)


def test_checkpoint_holds_only_the_adapters(runs):
    from strategies.checkpoint.dcp import saved_entries
    from trainer.rundir import resolve_checkpoint

    ckpt = resolve_checkpoint(runs["fsdp2"]["run_dir"])
    model_keys = set(saved_entries(ckpt, "model."))
    assert model_keys == set(runs["fsdp2"]["grads"][0]), "model state: the adapters only"
    optimizer_keys = {k for k in saved_entries(ckpt, "optimizer_0.state.")}
    assert optimizer_keys and all(".lora_" in k for k in optimizer_keys), "optimizer state: the adapters only"


def test_export_merges_and_writes_a_peft_adapter(runs, base, tmp_path):
    import transformers
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    from trainer.export import export_checkpoint
    from trainer.init_from import load_init_from
    from trainer.models.hf import plait_name
    from trainer.run_model import load_run_model

    run = runs["tp2"]  # a checkpoint written by 2 tensor-parallel ranks
    out = export_checkpoint(run["run_dir"], tmp_path / "export")
    merged = {plait_name(k): v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    params = run["params"]
    for name, weight in merged.items():
        module = name.removesuffix(".weight")
        expected = params[name]
        if f"{module}.lora_A.weight" in params:
            expected = expected + (ALPHA / RANK) * params[f"{module}.lora_B.weight"] @ params[f"{module}.lora_A.weight"]
        torch.testing.assert_close(weight, expected, rtol=0, atol=1e-6, msg=f"{name}: base + (alpha/r) B A")

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base / "hf").eval()
    with torch.no_grad():
        base_logits = hf_base(ids).logits
    peft_model = PeftModel.from_pretrained(hf_base, out / "adapter").eval()
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    adapted = {k.removesuffix(".lora_A.weight") for k in params if k.endswith(".lora_A.weight")}
    assert {plait_name(f"{n}.weight").removesuffix(".weight") for n in wrapped} == adapted, "peft adapts plait's layers"
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(base / "hf")  # the Hugging Face folder trained from
    with pytest.raises(ValueError, match="export the run first .* pass load_base=trainer.init_from.load_init_from"):
        load_run_model(run["run_dir"])
    plait_model = load_run_model(run["run_dir"], load_base=load_init_from).model  # base + adapters, unmerged
    with torch.no_grad():
        expected = plait_model(ids)
        assert (base_logits - expected).abs().max() > 1e-3, "the adapters change the model"
        torch.testing.assert_close(hf_merged(ids).logits, expected, **TOL, msg="transformers on the merged export")
        torch.testing.assert_close(peft_model(ids).logits, expected, **TOL, msg="peft with the exported adapter")

    alone = export_checkpoint(run["run_dir"], tmp_path / "merged_only", adapter=False)
    assert not (alone / "adapter").exists()
    torch.testing.assert_close(
        load_file(alone / "model.safetensors"), load_file(out / "model.safetensors"), rtol=0, atol=0
    )


def test_qlora_fit_on_cpu_lowers_the_loss(base, tmp_path):
    """QLoRA: the adapted layers' base in 4-bit NF4 (bitsandbytes' CPU backend); the adapters train."""

    overrides = [o for o in _overrides(base) if not o.startswith(("optim=", "trainer.max_steps="))]
    cfg = compose_config([
        *overrides, "optim=adamw", "optim.lr=1e-2", "trainer.max_steps=8", "strategy.lora.quantize=nf4",
        "train.micro_batch_size=8",
    ])  # fmt: skip
    _, task = fit(cfg, tmp_path)
    loss = losses(task.history)
    print("qlora losses", [round(x, 4) for x in loss])
    assert len(loss) == 8 and loss[-1] < loss[0] - 0.05, loss
    # The trained model's weights (recorded in the rank): the adapted layers hold packed NF4 codes,
    # two per byte, in float32 storage (8 per element); the others keep their float weight.
    params = [h["params"] for h in task.history if "params" in h][0]
    wq = params["layers.0.attention.wq.weight"]
    assert wq.dtype == torch.float32 and tuple(wq.shape) == (64 * 64 // 8, 1), wq.shape
    assert tuple(params["tok_embeddings.weight"].shape) == (300, 64)
    grads = [h["grads"] for h in task.history if "grads" in h][-1]
    assert grads and all(".lora_" in n for n in grads) and all(g.abs().sum() > 0 for g in grads.values())


def test_the_adapter_sizes_reach_the_rows_the_loggers_write(base, tmp_path):
    """LoRA's lora/trainable_bytes and lora/optimizer_state_bytes (docs/fine-tuning.md: logged after
    the first step) are in every row written: with trainer.log_every_n_steps=2, steps 2 and 4 (the
    first step's values alone never reached metrics.csv unless every step was logged)."""
    import csv

    cfg = compose_config([*_overrides(base), *LAYOUTS["one_process"], "trainer.log_every_n_steps=2", "logger=csv"])
    fit(cfg, tmp_path)
    rows = [r for r in csv.DictReader((tmp_path / "metrics.csv").open()) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [2, 4]
    sizes = {(float(r["lora/trainable_bytes"]), float(r["lora/optimizer_state_bytes"])) for r in rows}
    ((trainable, state),) = sizes  # the same values in both rows
    assert trainable > 0 and state == trainable  # SGD with momentum: one buffer per adapter weight
