"""A plait run as ``model.init_from``: the new run takes that run's architecture and tokenizer, a
conflicting model override is refused in validate naming the fix, and a one-file corpus holds out
validation rows instead of whole documents."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trainer.build import build_data
from trainer.compose import compose
from trainer.config import ConfigError, validate
from trainer.data.tokenizer import Tokenizer, train_bpe
from trainer.semantics import tokenizer_file

SMALL = ["data.seq_len=64", "trainer.max_steps=2"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished plait run of a 32-wide nano model: config.yaml, tokenizer.json, one intact checkpoint."""
    from strategies.checkpoint.manifest import checkpoint_files, hash_files, write_manifest

    run = tmp_path_factory.mktemp("base") / "pretrain"
    step = run / "checkpoints" / "step_0000002"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "meta.pt").write_bytes(b"")
    write_manifest(step, hash_files(step, checkpoint_files(step)))  # a finished save
    OmegaConf.save(compose("pretrain", ["model=nano", "model.dim=32", *SMALL]), run / "config.yaml", resolve=True)
    train_bpe(["the base run's own text " * 20], vocab_size=300).save(run / "tokenizer.json")
    return run


def test_the_run_brings_its_architecture_and_tokenizer(base_run: Path) -> None:
    cfg = compose("sft", [f"model.init_from={base_run}", *SMALL])  # the sft recipe's model is tiny (dim 192)
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (32, 2, 4)
    assert cfg.model.init_from == str(base_run)  # a full fine-tune keeps the directory
    assert tokenizer_file(cfg) == str(base_run / "tokenizer.json")
    own = Tokenizer.from_file(base_run / "tokenizer.json").vocab_size
    assert own < 300 < cfg.data.vocab_size
    assert validate(cfg).shape.vocab_size == own  # the run's tokenizer, not a BPE trained on the SFT data


def test_fields_that_keep_the_weights_may_differ(base_run: Path, tmp_path: Path) -> None:
    mine = tmp_path / "tokenizer.json"
    train_bpe(["another text " * 20], vocab_size=280).save(mine)
    cfg = compose("sft", [f"model.init_from={base_run}", "model.max_seq_len=96", f"data.tokenizer={mine}", *SMALL])
    assert (cfg.model.dim, cfg.model.max_seq_len) == (32, 96)
    assert tokenizer_file(cfg) == str(mine)  # a given tokenizer wins
    validate(cfg)


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("model.dim=64", "model.dim=64 differs from model.dim=32 of the run model.init_from names"),
        ("model=tiny", "model.n_layers=4 differs from model.n_layers=2"),
    ],
)
def test_a_conflicting_model_override_is_refused(base_run: Path, override: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose("sft", [f"model.init_from={base_run}", override, *SMALL]))
    assert any(problem in p and "drop the override" in p for p in err.value.problems), err.value.problems


def test_a_one_file_corpus_holds_out_rows(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "book.txt").write_text("".join(f"Line {i} of the only book, with some words.\n" for i in range(400)))
    cfg = compose(
        "pretrain", ["model=nano", f"data.path={folder}", "data.vocab_size=300", f"data.cache_dir={tmp_path}", *SMALL]
    )
    prepared = build_data(cfg).prepare()
    rows = len(prepared.train) + len(prepared.val)
    assert len(prepared.val) == max(1, round(0.02 * rows)) and len(prepared.train) >= 8
    # the held-out rows are the tail of the stream: the last one ends with the book's last line's tokens
    last = prepared.tokenizer.decode([t for t in prepared.val.input_ids[-1].tolist() if t != prepared.tokenizer.pad_id])
    assert "Line 399" in last


def test_recipe_help_shows_the_run_model(base_run: Path, capsys) -> None:
    from trainer.compose import to_hydra_argv
    from trainer.train import print_recipe_help

    print_recipe_help(to_hydra_argv(["sft", f"model.init_from={base_run}", "--help"]))
    assert "\nmodel:\n  _target_: trainer.models.llama.Llama\n  dim: 32\n" in capsys.readouterr().out  # not tiny's 192


def test_a_lora_run_pins_its_base_to_the_checkpoint_it_names_now(base_run: Path, tmp_path: Path) -> None:
    """A LoRA run's ``model.init_from=<run dir>`` records the run's newest checkpoint at launch: its
    checkpoints hold only adapters and it reloads the base on every load, so a base run that trains on
    must not change it. A full fine-tune keeps the directory (its checkpoints hold every weight; a
    pinned checkpoint the base's keep_last deleted would refuse its resume). Mutation: recording
    the directory for LoRA fails the first two asserts."""
    import shutil

    from strategies.checkpoint.manifest import checkpoint_files, hash_files, write_manifest

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    lora = [f"model.init_from={base}", "+strategy/lora=default", *SMALL]
    assert compose("sft", lora).model.init_from == str((base / "checkpoints" / "step_0000002").resolve())
    newer = base / "checkpoints" / "step_0000004"
    newer.mkdir()
    (newer / ".metadata").write_bytes(b"")
    (newer / "meta.pt").write_bytes(b"")
    write_manifest(newer, hash_files(newer, checkpoint_files(newer)))
    assert compose("sft", lora).model.init_from == str(newer.resolve())
    assert compose("sft", [*lora, "model=nano"]).model.init_from == str(newer.resolve())  # the user's architecture
    assert compose("sft", [f"model.init_from={base}", *SMALL]).model.init_from == str(base)  # full fine-tune
