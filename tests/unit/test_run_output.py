"""What a run prints: the progress bar's newest validation loss, the silenced third-party
warnings and banners, the one-line data summary."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from trainer.callbacks.progress import StepProgressBar
from trainer.data.mixture import SourceSamples
from trainer.data.packing import PackedRows
from trainer.data.summary import data_summary
from trainer.quiet import quiet_third_party
from trainer.task import Task


def test_the_bar_shows_the_newest_validation_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    # The evaluation after the last step comes after the bar's last per-step redraw: the bar reads
    # the task's history when it draws (the epoch's end redraws), so it never shows a stale value.
    from lightning.pytorch.callbacks import TQDMProgressBar

    monkeypatch.setattr(TQDMProgressBar, "get_metrics", lambda self, t, m: {"train/loss": 8.3, "v_num": "abcd"})
    task = SimpleNamespace(
        _history=[{"step": 0, "val_loss": 8.33}, {"step": 1, "loss": 8.3}, {"step": 5, "val_loss": 8.27}]
    )
    task.latest_val_loss = Task.latest_val_loss.fget(task)
    assert StepProgressBar().get_metrics(None, task) == {"train/loss": 8.3, "val/loss": 8.27}
    task._history = [{"step": 1, "loss": 8.3}]  # no evaluation yet (data.val_fraction=0)
    assert Task.latest_val_loss.fget(task) is None


def test_a_resumed_run_sizes_its_bar_to_the_whole_run() -> None:
    """Resumed at step 8 of 12 inside the epoch: Lightning skips on_train_epoch_start and its total
    (the steps left, 4) fell below the batch index (9), so the bar read "9/?" to the end (a reviewer's)."""
    current = SimpleNamespace(ready=8)
    trainer = SimpleNamespace(
        max_steps=12, global_step=8, num_training_batches=5168, current_epoch=0,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=current))),
    )  # fmt: skip
    bar = StepProgressBar()
    bar._trainer = trainer
    bar.init_train_tqdm = lambda: __import__("tqdm").tqdm(disable=True)
    bar.on_train_start(trainer, None)
    assert (bar.train_progress_bar.total, bar.train_progress_bar.n) == (12, 8)
    # The next epoch (5 batches) starts before Lightning clears the loop's count of the last one:
    # the bar counts from 0 (it read a negative rate from the count left over) and sizes the steps left.
    trainer.num_training_batches, trainer.global_step, current.ready = 5, 10, 5
    bar.on_train_epoch_start(trainer)
    assert (bar.train_progress_bar.total, bar.train_progress_bar.n, bar.train_progress_bar.initial) == (2, 0, 0)


def test_unactionable_warnings_and_banners_are_silenced_others_kept() -> None:
    quiet_third_party()
    with warnings.catch_warnings(record=True) as caught:
        # quiet_third_party's filters, not pytest's "always", decide (catch_warnings keeps them).
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", DeprecationWarning)
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming ...", UserWarning)
        warnings.warn("a warning plait's user should see", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning plait's user should see"]
    # The CLI silences before Lightning is imported, and importing it sets these two to INFO.
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    logging.getLogger("lightning.fabric").setLevel(logging.INFO)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.distributed"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name


def _rows(n: int, s: int) -> PackedRows:
    zeros = torch.zeros(n, s, dtype=torch.long)
    return PackedRows(input_ids=zeros, labels=zeros, position_ids=zeros, document_ids=zeros)


def test_the_data_summary_counts_each_kind_of_data() -> None:
    tokenizer = SimpleNamespace(vocab_size=4096)
    text = SimpleNamespace(tokenizer=tokenizer, train=_rows(10, 8), val=_rows(2, 8), documents=(7, 1))
    assert data_summary(text) == (
        "data: 10 training rows (80 tokens), 2 held-out rows (16 tokens); 7 training and 1 held-out documents; vocabulary 4,096"
    )
    assert data_summary(text, evaluated=1).startswith(
        "data: 10 training rows (80 tokens), 2 held-out rows (16 tokens; 1 evaluated);"
    )
    assert data_summary(text, evaluated=2) == data_summary(text)  # all of them: nothing to add
    sft = SimpleNamespace(
        tokenizer=tokenizer,
        train={"a": SourceSamples([[1, 2, 3]] * 4, [[1, 2, 3]] * 4), "b": SourceSamples([[1, 2]], [[1, 2]])},
        val={"a": SourceSamples([[1, 2, 3]], [[1, 2, 3]])},
    )
    assert (
        data_summary(sft)
        == "data: 5 training samples (14 tokens), 1 held-out samples (3 tokens); 2 sources; vocabulary 4,096"
    )
    pairs = SimpleNamespace(
        tokenizer=tokenizer, train={"input_ids": torch.zeros(6, 2, 4)}, val={"input_ids": torch.zeros(2, 2, 4)}
    )
    assert data_summary(pairs) == "data: 6 training pairs (48 tokens), 2 held-out pairs (16 tokens); vocabulary 4,096"
    # Real rows: 3 tokens, then the pad tail (a document of its own) is not counted (16 short pairs read
    # '8,192 tokens' at seq_len 256: a new user's walkthrough).
    docs = torch.tensor([0, 0, 0, 1]).expand(6, 2, 4)
    padded = SimpleNamespace(
        tokenizer=tokenizer,
        train={"input_ids": torch.zeros(6, 2, 4), "document_ids": docs},
        val={"input_ids": torch.zeros(2, 2, 4), "document_ids": docs[:2]},
    )
    assert data_summary(padded).startswith("data: 6 training pairs (36 tokens), 2 held-out pairs (12 tokens)")


def test_perplexity_only_for_a_per_token_nll() -> None:
    from trainer.held_out import val_metrics
    from trainer.objectives.kto import KTO
    from trainer.objectives.preference import DPO, ORPO
    from trainer.objectives.pretrain import CausalLM
    from trainer.objectives.sft import SFT

    for objective in (CausalLM(), SFT()):
        assert val_metrics(objective, 2.0, {"val/x": 1.0}) == {
            "val/loss": 2.0,
            "val/ppl": pytest.approx(7.389056),
            "val/x": 1.0,
        }
    for objective in (DPO(), ORPO(), KTO()):  # exp of a pair loss is no perplexity
        assert val_metrics(objective, 0.69, {}) == {"val/loss": 0.69}


class UserLM(torch.nn.Module):
    """A user's model with the interface every layout needs (README "Your own model") and nothing more."""

    def __init__(self, vocab_size: int, dim: int = 16, max_seq_len: int = 256) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_embeddings = torch.nn.Embedding(vocab_size, dim)
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(dim, dim)})
        self.output = torch.nn.Linear(dim, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids_bt=None, document_ids_bt=None) -> torch.Tensor:
        return self.output(self.layers["0"](self.tok_embeddings(input_ids)))


def _problems(model_target: str, overrides: list[str]) -> list[str]:
    from omegaconf import OmegaConf

    from trainer.compose import compose
    from trainer.config import ConfigError, validate

    cfg = compose("pretrain", ["model=nano", *overrides])
    if model_target != "nano":
        OmegaConf.set_struct(cfg, False)
        cfg.model = {"_target_": model_target, "dim": 16}
    try:
        validate(cfg)
    except ConfigError as err:
        return err.problems
    return []


def test_a_user_model_without_what_a_feature_needs_is_refused_in_validate() -> None:
    user = f"{__name__}.UserLM"
    assert _problems(user, ["trainer.max_steps=1"]) == []  # DDP needs nothing more
    tp = _problems(user, ["strategy=tp", "trainer.devices=2"])
    assert any(p.startswith("strategy.tp=2: UserLM declares no tp_plan") and "strategy.tp=1" in p for p in tp), tp
    export = _problems(user, ["callbacks.hf_export.at_end=true"])
    assert any(p.startswith("callbacks.hf_export: ") and "no Hugging Face mapping" in p for p in export), export
    # plait's Llama has both: neither problem.
    assert not any(
        "declares no" in p or "Hugging Face mapping" in p
        for p in _problems("nano", ["strategy=tp", "trainer.devices=2", "callbacks.hf_export.at_end=true"])
    )


def test_an_export_during_the_run_is_refused_where_it_cannot_be_written() -> None:
    """`HFExport.problems`: pipeline stages and LoRA adapters are refused before launch, naming
    ``plait export`` and the setting that turns the export off (LoRA trained the whole run and then
    crashed in on_train_end: the setup check looked for a strategy attribute that does not exist)."""
    pp = _problems("nano", ["strategy=pp", "trainer.devices=2", "callbacks.hf_export.at_end=true"])
    assert [p for p in pp if p.startswith("callbacks.hf_export")] == [
        "callbacks.hf_export needs pp=1 (strategy.pp=2: each pipeline rank holds one stage); export after the run "
        "with plait export ckpt=<run dir> out=<dir>, or callbacks.hf_export.at_end=false"
    ], pp
    lora = _problems("nano", ["+strategy/lora=default", "callbacks.hf_export.every_n_steps=5"])
    assert any(
        p.startswith("callbacks.hf_export does not merge LoRA adapters")
        and p.endswith("callbacks.hf_export.every_n_steps=0")
        for p in lora
    ), lora
    assert not [p for p in _problems("nano", ["+strategy/lora=default"]) if "hf_export" in p]


def test_cpu_offload_where_fsdp_shards_nothing_is_refused() -> None:
    """One rank holds each parameter (one process): strategy.fsdp.cpu_offload=true offloaded nothing
    and was accepted (a fresh reviewer); sharded over 2 ranks it is FSDP2's CPUOffloadPolicy."""
    alone = [p for p in _problems("nano", ["strategy.fsdp.cpu_offload=true"]) if "cpu_offload" in p]
    assert alone == [
        "strategy.fsdp.cpu_offload=true offloads FSDP's shards, but no FSDP shards at this layout (dp_shard=1 x cp=1 "
        "x dp_replicate=1 = 1 rank per parameter); shard over more ranks (strategy=fsdp trainer.devices=N), or "
        "strategy.fsdp.cpu_offload=false"
    ]
    sharded = ["strategy=fsdp", "trainer.devices=2", "strategy.fsdp.cpu_offload=true"]
    assert not [p for p in _problems("nano", sharded) if "cpu_offload" in p]


def test_a_param_dtype_where_fsdp_shards_nothing_is_warned_unless_the_precision_gives_it() -> None:
    """strategy.fsdp.param_dtype=bf16 on one process trained in fp32, the same losses to every digit (a
    fresh reviewer): FSDP shards nothing there, and the launch says so. trainer=gpu's bf16 with
    bf16-mixed is the autocast's; a warning, not a refusal: trainer=gpu trainer.precision=32-true on one
    GPU asks for fp32, and gets it."""

    from trainer.compose import compose
    from trainer.config import validate

    def notes(*overrides: str) -> list[str]:
        return [n for n in validate(compose("pretrain", ["model=nano", *overrides])).notes if "param_dtype" in n]

    (note,) = notes("strategy.fsdp.param_dtype=bf16")
    assert note.startswith("strategy.fsdp.param_dtype=bf16 casts the parameters FSDP gathers, but no FSDP shards"), note
    assert "computes in trainer.precision=32-true; for bf16 compute set trainer.precision=bf16-mixed" in note, note
    (fp16,) = notes("strategy.fsdp.param_dtype=fp16")
    assert fp16.endswith("for fp16 compute shard over more ranks (strategy=fsdp trainer.devices=N)"), fp16
    for fine in (
        ["strategy.fsdp.param_dtype=bf16", "trainer.precision=bf16-mixed"],
        ["strategy=fsdp", "trainer.devices=2", "strategy.fsdp.param_dtype=bf16"],
        ["strategy.fsdp.param_dtype=fp32"],
    ):
        assert not notes(*fine), fine
    assert not [p for p in _problems("nano", ["trainer=gpu", "trainer.precision=32-true"]) if "param_dtype" in p]


def test_import_notices_a_user_cannot_act_on_are_dropped() -> None:
    """torchao's CUDA extensions that do not load on CPU, bitsandbytes' remote CPU kernel and torch's
    enum notice printed on every LoRA, QLoRA and float8 command (a new user's walkthrough); the
    libraries' other warnings stay."""
    import subprocess
    import sys

    code = (
        "from trainer.quiet import quiet_third_party; quiet_third_party()\n"
        "import logging, torchao, bitsandbytes\n"
        "logging.getLogger('torchao').warning('Failed to load the next thing: kept')\n"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
    assert "Failed to load the next thing: kept" in err, err
    assert "_C_mxfp8" not in err and "gemm_4bit_forward" not in err and "Enum subclass" not in err, err


def test_the_launch_names_the_mesh_a_run_of_several_ranks_trains_on() -> None:
    """strategy=fsdp_tp on 2 ranks runs tp=2 alone; nothing said so (a new user read config.yaml)."""
    from strategies.core.parallel_dims import ParallelDims
    from trainer.run import layout_line

    def line(world: int, islands: bool = False, ep: int = 1, **degrees: int) -> str | None:
        return layout_line(SimpleNamespace(world_size=world, dims=ParallelDims(**degrees), islands=islands), ep=ep)

    assert line(2, dp_shard=1, tp=2) == "layout: 2 ranks, tp=2"
    assert (
        line(4, True, dp_replicate=2, dp_shard=2)
        == "layout: 4 ranks, dp_replicate=2 x dp_shard=2 (local-SGD islands: dp_replicate)"
    )
    assert line(1, dp_shard=1) is None
    # expert parallelism borrows its ranks from dp_shard x cp: it read 'layout: 2 ranks, dp_shard=2' (a reviewer)
    assert line(2, ep=2, dp_shard=2) == "layout: 2 ranks, dp_shard=2; experts over ep=2 of them"


def test_a_message_during_training_starts_its_own_line(capsys) -> None:
    """GRPO's and the roll-back's warnings ran on after Lightning's progress bar (a new user's
    grep '^plait' missed them): `say` clears the bar first."""
    import sys

    from tqdm import tqdm

    from trainer.catalog import say

    bar = tqdm(total=3, file=sys.stderr, desc="Epoch 0")
    bar.update(1)
    say("warning: something")
    bar.close()
    err = capsys.readouterr().err
    before = err[: err.index("plait: warning: something")]
    assert before.endswith("\n"), repr(before[-40:])  # captured like a log file: a newline, not only "\r"
    assert any(line.startswith("plait: warning: something") for line in err.split("\n"))


def test_the_export_callback_gets_the_sources_plait_export_uses(tmp_path) -> None:
    """``callbacks.hf_export`` writes what ``plait export`` writes: the builder hands it
    `trainer.hf_sources.source_dirs` of the run's config, so a chain from a Hugging Face model
    (``model.config_from``) keeps that directory's config.json fields and generation_config.json.
    Mutation: taking the sources from ``model.init_from`` alone (the callback's own rule before)
    leaves the chain's Hugging Face directory out."""
    from hf_checkpoints import make_hf_dir
    from omegaconf import OmegaConf

    from trainer.build import build_callbacks
    from trainer.callbacks.hf_export import HFExport
    from trainer.compose import compose
    from trainer.hf_sources import source_dirs

    hub = tmp_path / "hub"
    make_hf_dir("llama3", hub)
    cfg = compose("sft", ["model=hf", f"model.init_from={hub}", "callbacks.hf_export.at_end=true"])
    OmegaConf.update(cfg, "model.init_from", str(tmp_path / "a_plait_run"))  # a chain's second run
    OmegaConf.update(cfg, "model.config_from", str(hub))
    (export,) = [c for c in build_callbacks(cfg, tmp_path / "run") if isinstance(c, HFExport)]
    assert export.model_sources == source_dirs(cfg) and hub in export.model_sources


def test_an_export_the_model_cannot_fit_is_refused_before_training() -> None:
    """``callbacks.hf_export`` on a mixture of experts no Hugging Face family holds (moe_tiny: shared
    experts, dense blocks) trained to the end and then raised HFError (under FSDP + EP, 'lost rank 0
    ... resume=last', which would fail again). validate now asks the family check on the meta model.
    Mutation: dropping export_fit_problems from validate lets it through."""
    import pytest

    from trainer.compose import compose
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose("pretrain", ["model=moe_tiny", "callbacks.hf_export.at_end=true", "data.seq_len=64"]))
    assert any("callbacks.hf_export: this mixture of experts does not fit" in p for p in err.value.problems)
    validate(compose("pretrain", ["model=nano", "callbacks.hf_export.at_end=true", "data.seq_len=64"]))


def test_a_resume_that_reshapes_the_decaying_schedule_says_so() -> None:
    """plait resume <run> trainer.max_steps=200 on a 400-step cosine run moved the lr from 0.00272 to
    0.00167 at step 110 with only 'resume: trainer.max_steps: 400 -> 200' said. Mutation: comparing the
    lr at the new length with itself (no warning) fails."""
    from harness import compose_config

    from trainer.optim import lr_factor
    from trainer.run import schedule_line

    cfg = compose_config(["scheduler=cosine", "scheduler.warmup_steps=20", "optim.lr=3e-3"])
    line = schedule_line(cfg, 100, 400, 200, 400)
    shape = {"warmup_steps": 20, "decay": "cosine", "min_lr_ratio": cfg.scheduler.min_lr_ratio}
    before, after = (3e-3 * lr_factor(100, total_steps=n, **shape) for n in (400, 200))
    assert f"lr {after:.3g} where the run was at {before:.3g}" in line and "trainer.max_steps=400" in line
    assert schedule_line(cfg, 100, 400, 401, 400) is None  # under 1%
    assert schedule_line(cfg, 10, 24, 24, 100000) is None  # a run its data ends: the same planned steps
    assert schedule_line(compose_config(["scheduler=constant"]), 100, 400, 200, 400) is None
    # a scheduler that leaves warmup, decay and min_lr_ratio to WarmupDecayLR's defaults (a KeyError before)
    bare = compose_config(["~scheduler", "+scheduler={_target_: trainer.optim.WarmupDecayLR, _partial_: true}"])
    assert "the cosine schedule now decays over 200 steps, not 400" in schedule_line(bare, 100, 400, 200, 400)
