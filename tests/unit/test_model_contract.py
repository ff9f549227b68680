"""The model's declared contract (`strategies.core.model_contract`): a layout that reads a member the
model does not declare is refused by validate, naming the member, never skipped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strategies.core.model_contract import DecoderModel, layout_problems
from strategies.core.shape import ModelContractError, ModelShape
from trainer.models.llama import Llama


class Bare(nn.Module):
    """Only what DDP and FSDP2 read: ``layers`` and ``forward`` (README "Your own model")."""

    def __init__(self, vocab_size: int, dim: int = 16, max_seq_len: int = 256) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({"0": nn.Linear(dim, dim)})
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids_bt=None, document_ids_bt=None) -> torch.Tensor:
        return self.output(self.layers["0"](self.tok_embeddings(input_ids)))


class NoCore(Llama):
    """A Llama whose attention cannot be swapped: everything but context parallelism's member."""

    def __getattribute__(self, name: str):
        if name == "set_attention_core":
            raise AttributeError(name)
        return super().__getattribute__(name)


def _problems(target: str, overrides: list[str]) -> list[str]:
    from omegaconf import OmegaConf

    from trainer.compose import compose
    from trainer.config import ConfigError, validate

    cfg = compose("pretrain", ["model=nano", *overrides])
    if target != "nano":
        OmegaConf.set_struct(cfg, False)
        cfg.model = {"_target_": target, "dim": 16} if target.endswith("Bare") else {**cfg.model, "_target_": target}
    try:
        validate(cfg)
    except ConfigError as err:
        return err.problems
    return []


def test_model_shape_names_the_missing_size() -> None:
    with pytest.raises(ModelContractError, match=r"model: Bare declares no vocab_size, dim, n_layers, n_heads"):
        ModelShape.of(Bare(vocab_size=8))
    assert ModelShape.problem(Llama(vocab_size=8, dim=8, n_layers=1, n_heads=2)) is None
    assert isinstance(Llama(vocab_size=8, dim=8, n_layers=1, n_heads=2), DecoderModel)


def test_layout_problems_name_each_member_per_axis() -> None:
    bare = Bare(vocab_size=8)
    assert layout_problems(bare, {"tp": 1, "cp": 1, "pp": 1}) == []  # DDP / FSDP2 read nothing more
    pp = layout_problems(bare, {"pp": 2})
    assert any(p.startswith("strategy.pp=2: Bare declares no norm; add self.norm") for p in pp), pp
    assert any(p.startswith("strategy.pp=2: Bare declares no return_hidden; add a keyword") for p in pp), pp
    assert any(
        "declares no vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_dim, tie_embeddings" in p for p in pp
    ), pp
    assert layout_problems(bare, {"tp": 2}, tp_plan=False)[0].startswith("strategy.tp=2: Bare declares no vocab_size")
    # A class (the model cannot be built yet): only the members a class declares.
    assert layout_problems(Bare, {"tp": 2}) == [layout_problems(bare, {"tp": 2})[0]]
    llama = Llama(vocab_size=8, dim=8, n_layers=1, n_heads=2)
    assert layout_problems(llama, {"tp": 2, "cp": 2, "pp": 2}) == []


def test_validate_refuses_a_layout_whose_members_the_model_lacks() -> None:
    bare = f"{__name__}.Bare"
    assert _problems(bare, ["trainer.max_steps=1"]) == []  # DDP: nothing more is read
    pp = _problems(bare, ["strategy=pp", "trainer.devices=2"])
    assert any(p.startswith("strategy.pp=2: Bare declares no norm") for p in pp), pp
    assert any("strategy.pp=2: Bare declares no vocab_size, dim" in p for p in pp), pp
    cp = _problems(f"{__name__}.NoCore", ["strategy=cp", "trainer.devices=2"])
    assert any(p.startswith("strategy.cp=2: NoCore declares no set_attention_core; add") for p in cp), cp
    assert not any("declares no" in p for p in _problems("nano", ["strategy=cp", "trainer.devices=2"]))


def test_init_from_is_read_off_the_node_never_by_the_model() -> None:
    import inspect

    from omegaconf import OmegaConf

    from trainer.model_node import constructor_node, init_from_of, instantiate_model

    node = OmegaConf.create(
        {
            "_target_": "trainer.models.llama.Llama",
            "vocab_size": 8,
            "dim": 8,
            "n_layers": 1,
            "n_heads": 2,
            "init_from": "runs/base",
        }
    )
    model = instantiate_model(node)  # the constructor never sees init_from
    assert "init_from" not in inspect.signature(Llama).parameters and "init_from" not in vars(model)
    assert init_from_of(node) == "runs/base" and node.init_from == "runs/base"  # the node is not changed
    # A factory that reads the architecture from that directory takes it.
    hf = OmegaConf.create({"_target_": "trainer.models.hf.llama_from_hf", "init_from": "hf_dir"})
    assert constructor_node(hf).init_from == "hf_dir"


def test_models_import_no_technique_no_tokenizer_no_run_directory() -> None:
    """trainer/models/ imports only the bottom layer of strategies/ (ranges, the model contract, the
    modules' Hugging Face names)."""
    import ast
    from pathlib import Path

    allowed = {
        "strategies.core.ranges",
        "strategies.core.model_contract",
        "strategies.core.shape",
        "strategies.core.hf_names",
    }
    # Known and left: SAT's sliced MLP reads LoRA adapters through strategies.transforms.lora.linear_slice.
    known = {("block.py", "strategies.transforms.lora")}
    found = []
    for path in sorted((Path(__file__).parents[2] / "trainer" / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = node.module
                bad = (module.startswith("strategies.") and module not in allowed) or module.startswith(
                    ("trainer.rundir", "trainer.data", "trainer.init_from")
                )
                if bad and (path.name, module) not in known:
                    found.append(f"{path.name}: {module}")
    assert found == []


@pytest.mark.slow  # a CLI run; the rule is held by test_validate_refuses_a_layout_whose_members_the_model_lacks
def test_the_cli_refuses_before_launch_naming_the_member(tmp_path) -> None:
    """``plait pretrain`` with a user's model under pipeline stages: exit 2, the member named, nothing run."""
    import inspect
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "my_lm.py").write_text(
        "import torch\nfrom torch import nn\n\n\n" + inspect.getsource(Bare), encoding="utf-8"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLAIT_USER_PATH")}
    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("plait")),
            "--user-path",
            str(tmp_path),
            "pretrain",
            "~model",
            "+model._target_=my_lm.Bare",
            "strategy=pp",
            "trainer.devices=2",
            f"run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "strategy.pp=2: Bare declares no norm; add self.norm" in result.stderr, result.stderr
    assert "strategy.pp=2: Bare declares no return_hidden" in result.stderr
    assert not (tmp_path / "run").exists()


def test_every_model_in_conf_declares_the_whole_contract() -> None:
    """conf/model/*.yaml (model=hf reads a directory: its classes are those of trainer.models.families)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from strategies.core.model_contract import MixtureOfExperts
    from trainer.model_node import instantiate_model
    from trainer.models.moe_transformer import MoETransformer

    presets = sorted((Path(__file__).parents[2] / "conf" / "model").glob("*.yaml"))
    assert len(presets) > 5
    for preset in presets:
        node = OmegaConf.load(preset)
        if OmegaConf.is_missing(node, "init_from"):
            continue
        with torch.device("meta"):
            model = instantiate_model(node, **({} if node.get("vocab_size") else {"vocab_size": 256}))
        assert isinstance(model, DecoderModel), preset.name
        assert layout_problems(model, {"tp": 2, "cp": 2, "pp": 2}) == [], preset.name
        assert isinstance(model, MixtureOfExperts) == isinstance(model, MoETransformer), preset.name
