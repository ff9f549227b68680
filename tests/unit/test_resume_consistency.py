"""A resume that would train another run is refused with every difference listed; an explicit
``resume_override`` of an optimizer field makes the new value the one the next step uses."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.resume import resume_problems, run_record

SAVED = {
    "seed": 0,
    "model": {"_target_": "trainer.models.llama.Llama", "dim": 64, "n_layers": 2, "init_from": None},
    "data": {"seq_len": 64, "sources": {"a": {"weight": 1.0}}, "cache_dir": "/c1", "tokenizer": None},
    "objective": {"_target_": "trainer.objectives.causal_lm.CausalLM"},
    "optim": {"lr": 3e-3, "weight_decay": 0.1},
    "scheduler": {"warmup_steps": 20},
    "train": {"max_grad_norm": 1.0, "eval_every": 50, "global_batch_size": 8, "micro_batch_size": 4},
    "trainer": {"max_steps": 100, "devices": 1},
}


def _new(**changes: object) -> dict:
    import copy

    cfg = copy.deepcopy(SAVED)
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def test_same_run_with_another_layout_and_length_resumes() -> None:
    new = _new(trainer__max_steps=400, trainer__devices=4, train__eval_every=10, data__cache_dir="/c2")
    assert resume_problems(run_record(SAVED, "f" * 64), new, "f" * 64, [], source="ckpt") == []


def test_every_difference_is_listed_with_its_fix() -> None:
    new = _new(model__dim=128, data__sources={"b": {"weight": 1.0}}, optim__lr=1e-3, seed=1)
    problems = resume_problems(run_record(SAVED, "f" * 64), new, "e" * 64, [], source="ckpt")
    text = "\n".join(problems)
    assert len(problems) == 6, text  # tokenizer, model.dim, data.sources.a.weight + .b.weight, optim.lr, seed
    assert "tokenizer differs" in text and "model.dim=128 differs from 64" in text
    # a key one side lacks reads as such, and its fix restores the saved side (absent: without it)
    assert "data.sources.b.weight=1.0 is not set in ckpt" in text and "resume without data.sources.b.weight," in text
    assert "data.sources.a.weight is not set, where ckpt has data.sources.a.weight=1.0" in text
    assert "resume with data.sources.a.weight=1.0," in text and "model.init_from=ckpt" in text
    assert "resume_override=[optim.lr]" in text and "seed=1 differs from 0" in text


def test_override_allows_optimizer_fields_only() -> None:
    record = run_record(SAVED, "f" * 64)
    assert resume_problems(record, _new(optim__lr=1e-3), "f" * 64, ["optim.lr"], source="ckpt") == []
    assert (
        resume_problems(
            record, _new(optim__lr=1e-3, scheduler__warmup_steps=0), None, ["optim", "scheduler"], source="c"
        )
        == []
    )
    assert (
        len(resume_problems(record, _new(optim__lr=1e-3, scheduler__warmup_steps=0), None, ["optim"], source="c")) == 1
    )
    problems = resume_problems(record, _new(model__dim=32), None, ["model.dim"], source="ckpt")
    assert any("only optim, scheduler, train.max_grad_norm" in p for p in problems), problems


def test_another_optimizer_class_is_refused_even_when_named_in_resume_override() -> None:
    """A reviewer: ``optim=sgd resume_override=[optim]`` (or ``optim=muon``) on an AdamW run passed the
    checks, then the load failed with "it is damaged or was written for another model"; the refusal
    without the override had even recommended ``resume_override=[optim._target_]``."""
    record = run_record({**SAVED, "optim": {**SAVED["optim"], "_target_": "torch.optim.AdamW"}}, "f" * 64)
    sgd = _new(optim__lr=1e-3)
    sgd["optim"] = {"_target_": "torch.optim.SGD", "lr": 1e-3}
    for overrides in ([], ["optim"], ["optim._target_"]):
        problems = resume_problems(record, sgd, None, overrides, source="ckpt")
        (problem,) = [p for p in problems if p.startswith("optim._target_")]
        assert "holds the optimizer state of optim._target_='torch.optim.AdamW'" in problem, problem
        assert "resume with the run's own optimizer (drop the optim override" in problem, problem
        assert "model.init_from=ckpt" in problem
        assert not any("resume_override=[optim._target_]" in p for p in problems), problems
    adamw = _new(optim__lr=1e-3)
    adamw["optim"]["_target_"] = "torch.optim.AdamW"
    assert resume_problems(record, adamw, None, ["optim"], source="c") == []  # the same class: lr is free


def test_a_new_global_batch_size_is_refused_a_new_micro_batch_size_resumes() -> None:
    # Before: both were free; the saved position counts global batches, so 8 -> 16 rows per batch
    # would have skipped half an epoch's rows (and the micro-batch size only splits the same batch).
    record = run_record(SAVED, "f" * 64)
    (problem,) = resume_problems(record, _new(train__global_batch_size=16), None, [], source="ckpt")
    assert (
        "train.global_batch_size=16 differs from 8 in ckpt: the saved data position would index other rows" in problem
    )
    assert "resume with train.global_batch_size=8" in problem and "model.init_from=ckpt" in problem
    assert resume_problems(record, _new(train__micro_batch_size=2), None, [], source="ckpt") == []


def test_a_launch_builds_its_trainer_with_the_callback_that_records_the_run(tmp_path) -> None:
    """`trainer.run.start` hands the run's `ResumeRecord` to the builder: the trainer is built with
    it (once, after the config's callbacks), never appended to a built trainer."""
    from harness import compose_config

    from trainer.config import validate
    from trainer.resume_record import ResumeRecord
    from trainer.run import Launch, start

    cfg = compose_config(["trainer.max_steps=2"])
    trainer, _, data = start(cfg, tmp_path, Launch(validate(cfg), None), launching=False)
    records = [c for c in trainer.callbacks if isinstance(c, ResumeRecord)]
    assert len(records) == 1 and records[0].tokenizer is data.tokenizer


def test_another_composed_config_is_pointed_at_plait_resume(tmp_path) -> None:
    """``run_dir=RUN resume=last`` typed without the run's overrides differs in many fields: the
    refusal leads with ``plait resume RUN`` (the run's own config) and lists three, not forty."""
    from omegaconf import OmegaConf

    from trainer.config import ConfigError
    from trainer.resume import RECORD_KEY, check_resume

    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000004"
    checkpoint.mkdir(parents=True)
    torch.save({RECORD_KEY: run_record(SAVED, "f" * 64)}, checkpoint / "meta.pt")
    new = OmegaConf.create(_new(model__dim=128, model__n_layers=9, data__sources={"b": {"weight": 1.0}}, seed=1))
    with pytest.raises(ConfigError) as err:
        check_resume(new, checkpoint)
    problems = err.value.problems
    assert problems[0].endswith(f"continue the run with its own config: plait resume {tmp_path / 'run'} [overrides]")
    assert len(problems) == 5 and problems[-1] == "... and 2 more", problems


def test_lora_settings_belong_to_the_run() -> None:
    """A LoRA checkpoint holds adapters of the run's rank and targets: another rank (or LoRA off) is
    refused before the load, not reported as a damaged checkpoint."""
    saved = {**SAVED, "strategy": {"lora": {"rank": 4, "target_modules": ["wq"]}}}
    new = {**saved, "strategy": {"lora": {"rank": 16, "target_modules": ["wq"]}}}
    problems = resume_problems(run_record(saved, "f" * 64), new, "f" * 64, [], source="ckpt")
    assert problems == [
        "strategy.lora.rank=16 differs from 4 in ckpt: the checkpoint's weights and loss belong to "
        "strategy.lora.rank=4; resume with strategy.lora.rank=4, or start a new run_dir"
    ]
    off = resume_problems(run_record(saved, "f" * 64), {**saved, "strategy": {}}, "f" * 64, [], source="ckpt")
    assert len(off) == 2 and "strategy.lora.rank is not set, where ckpt has strategy.lora.rank=4" in off[0], off


def test_the_data_path_is_compared_as_the_files_it_names(tmp_path, monkeypatch) -> None:
    """A path made absolute at launch (`absolute_paths`), a trailing slash or ``./``, and a path
    recorded as typed by an older run, name the same files from here: no difference; another
    folder is one."""
    from omegaconf import OmegaConf

    from trainer.data.config_paths import absolute_paths

    tmp_path = tmp_path.resolve()  # the recorded paths are canonical (symlinks resolved)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"data": {"path": "./corpus/", "tokenizer": None}})
    assert absolute_paths(cfg).data.path == str(tmp_path / "corpus")
    listed = OmegaConf.create({"data": {"path": ["corpus", "missing/"], "tokenizer": "other/"}})
    assert OmegaConf.to_container(absolute_paths(listed).data) == {
        "path": [str(tmp_path / "corpus"), "missing/"],  # one that does not exist stays as typed (validate names it)
        "tokenizer": str(tmp_path / "other"),
    }
    # ".." after a symlink is where the OS goes (the link's target's parent), not the text before it.
    (tmp_path / "other" / "deep").mkdir()
    (tmp_path / "other" / "corpus").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "other" / "deep")
    linked = OmegaConf.create({"data": {"path": "link/../corpus", "tokenizer": None}})
    assert absolute_paths(linked).data.path == str(tmp_path / "other" / "corpus")
    # An interpolation that does not resolve is left for validate's one-line message.
    broken = OmegaConf.create({"data": {"path": "${oc.env:PLAIT_NO_SUCH_DIR}/corpus", "tokenizer": None}})
    assert OmegaConf.to_container(absolute_paths(broken).data)["path"] == "${oc.env:PLAIT_NO_SUCH_DIR}/corpus"
    record = run_record(_new(data__path="corpus"), "f" * 64)
    for same in (str(tmp_path / "corpus"), f"{tmp_path / 'corpus'}/", "./corpus"):
        assert resume_problems(record, _new(data__path=same), "f" * 64, [], source="ckpt") == [], same
    (problem,) = resume_problems(record, _new(data__path=str(tmp_path / "other")), "f" * 64, [], source="ckpt")
    assert f"data.path={str(tmp_path / 'other')!r} differs from 'corpus'" in problem


def test_a_sources_local_file_and_the_model_to_start_from_are_made_absolute(tmp_path, monkeypatch) -> None:
    """``data.sources.<name>.source`` naming a local file, and ``model.init_from``, are made absolute
    at launch (a resume from another folder finds them; a recorded relative source compares as its
    file); a bundled source's name stays a name even where a file of that name exists here."""
    from omegaconf import OmegaConf

    from trainer.data.config_paths import absolute_paths

    tmp_path = tmp_path.resolve()
    (tmp_path / "mine.jsonl").write_text("{}\n")
    (tmp_path / "alpaca").mkdir()  # a folder named like the bundled source
    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create(
        {
            "model": {"init_from": "base/", "config_from": None},
            "data": {
                "path": None,
                "tokenizer": None,
                "sources": {
                    "mine": {"source": "./mine.jsonl", "limit": None},
                    "general": {"source": "alpaca"},
                    "missing": {"source": "nowhere.jsonl"},
                    "broken": {"source": "${oc.env:PLAIT_NO_SUCH_DIR}/x.jsonl"},
                    "implied": {"limit": 3},
                },
            },
        }
    )
    done = OmegaConf.to_container(absolute_paths(cfg))
    assert done["model"]["init_from"] == str(tmp_path / "base")
    assert done["data"]["sources"] == {
        "mine": {"source": str(tmp_path / "mine.jsonl"), "limit": None},
        "general": {"source": "alpaca"},
        "missing": {"source": "nowhere.jsonl"},
        "broken": {"source": "${oc.env:PLAIT_NO_SUCH_DIR}/x.jsonl"},
        "implied": {"limit": 3},
    }
    # A name of another catalog than the data module's is a path to it: 'alpaca' is an SFT set, not a pair set.
    pairs = OmegaConf.create(
        {"data": {"_target_": "trainer.data.preference.PreferenceDataModule", "sources": {"x": {"source": "alpaca"}}}}
    )
    assert absolute_paths(pairs).data.sources.x.source == str(tmp_path / "alpaca")
    record = run_record(_new(data__sources={"mine": {"source": "mine.jsonl"}}), "f" * 64)
    same = _new(data__sources={"mine": {"source": str(tmp_path / "mine.jsonl")}})
    assert resume_problems(record, same, "f" * 64, [], source="ckpt") == []
    other = _new(data__sources={"mine": {"source": str(tmp_path / "base")}})
    (problem,) = resume_problems(record, other, "f" * 64, [], source="ckpt")
    assert "data.sources.mine.source=" in problem


def test_a_resume_where_the_data_ends_is_refused(tmp_path) -> None:
    """An SFT run its data ended (step 8 of trainer.max_steps=100000) resumed with more max_steps
    trained nothing and recorded the change; `check_not_spent` refuses it, naming what ends the data
    and the new run that trains on. A checkpoint before the data's end, or a run max_steps ends, resumes."""
    from trainer.config import ConfigError
    from trainer.run import check_not_spent
    from trainer.run_length import DATA_EXHAUSTED, RunLength

    ckpt = tmp_path / "run" / "checkpoints" / "step_0000008"
    ckpt.mkdir(parents=True)
    torch.save({"global_step": 8}, ckpt / "meta.pt")
    reason = "data.sources.mine is spent after max_epochs=1.0 (8 steps); raise +data.sources.mine.max_epochs"
    # the run saved step 8 and died before its end (no summary.json): a resume does what ends the run
    check_not_spent(RunLength(100000, 8, DATA_EXHAUSTED, reason), ckpt)
    # ... also when the exception that ended it wrote the summary (an export that failed at the end)
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"steps": 8, "stopped_by": "interrupted"}))
    check_not_spent(RunLength(100000, 8, DATA_EXHAUSTED, reason), ckpt)
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"steps": 8, "stopped_by": "data_exhausted"}))
    with pytest.raises(ConfigError) as err:
        check_not_spent(RunLength(100000, 8, DATA_EXHAUSTED, reason), ckpt)
    (problem,) = err.value.problems
    assert problem.startswith(f"{ckpt} is at step 8, where the run's data ends ({reason}): resuming trains nothing")
    assert f"model.init_from={ckpt}" in problem
    check_not_spent(RunLength(100000, 9, DATA_EXHAUSTED, reason), ckpt)
    check_not_spent(RunLength(8, 8), ckpt)  # max_steps ended it: check_run_dir answers a max_steps too low
    check_not_spent(RunLength(100000, 8, DATA_EXHAUSTED, reason), None)


def test_local_sgd_on_or_off_belongs_to_the_run() -> None:
    """A DiLoCo checkpoint holds every island's weights, the anchor and the outer optimizer: a
    resume without it (strategy=ddp) went on from island 0 in silence, one with it onto a DDP
    checkpoint failed in the load; both are refused before anything loads. Its settings may change."""
    diloco = {**SAVED, "strategy": {"local_sgd": {"_target_": "strategies.local_sgd.DiLoCo", "sync_every": 50}}}
    ddp = {**SAVED, "strategy": {"local_sgd": None}}
    (off,) = resume_problems(run_record(diloco, "f" * 64), ddp, "f" * 64, [], source="ckpt")
    assert off.startswith("strategy.local_sgd._target_ is not set, where ckpt has strategy.local_sgd._target_=")
    assert "ckpt holds its islands (strategies.local_sgd.DiLoCo)" in off and "plait resume <run dir> keeps it" in off
    (on,) = resume_problems(run_record(ddp, "f" * 64), diloco, "f" * 64, [], source="ckpt")
    assert on.startswith("strategy.local_sgd._target_='strategies.local_sgd.DiLoCo' is not set in ckpt")
    assert "ckpt holds no islands (local SGD off)" in on and "resume with ...=" not in on
    slower = {**diloco, "strategy": {"local_sgd": {**diloco["strategy"]["local_sgd"], "sync_every": 10}}}
    assert resume_problems(run_record(diloco, "f" * 64), slower, "f" * 64, [], source="ckpt") == []


def test_data_that_changed_under_the_same_config_is_refused() -> None:
    """The recorded data fingerprint against the new run's: another one is refused (naming the fix);
    the same one, an unknown one (None) or a record written before it was kept resume."""
    record = run_record(SAVED, "f" * 64, "a" * 16)
    (problem,) = resume_problems(record, _new(), "f" * 64, [], source="ckpt", data_fingerprint="b" * 16)
    assert problem.startswith("the training data differs from the data ckpt was trained on (fingerprint aaaa")
    assert "model.init_from=ckpt" in problem
    assert resume_problems(record, _new(), "f" * 64, [], source="ckpt", data_fingerprint="a" * 16) == []
    assert resume_problems(record, _new(), "f" * 64, [], source="ckpt", data_fingerprint=None) == []
    older = {k: v for k, v in record.items() if k != "data"}
    assert resume_problems(older, _new(), "f" * 64, [], source="ckpt", data_fingerprint="b" * 16) == []


def test_a_partial_last_batch_pins_the_data_parallel_degree() -> None:
    """With data.drop_last=false the last, partial global batch of an epoch is trimmed to a multiple
    of dp rows, so a resume at another dp would continue on other rows: refused, naming the saved
    dp; with drop_last=true (or the same dp, or a record without dp) it resumes. The launch warns
    of it at validate (`trainer.semantics.batch_notes`)."""
    from harness import compose_config

    from trainer.config import validate

    saved = _new(data__drop_last=False)
    record = run_record(saved, "f" * 64, "a" * 16, 2)
    (problem,) = resume_problems(record, saved, "f" * 64, [], source="ckpt", dp=4)
    assert "was trained at dp=2, this layout has dp=4" in problem and "= 2)" in problem
    assert resume_problems(record, saved, "f" * 64, [], source="ckpt", dp=2) == []
    kept = run_record(_new(data__drop_last=True), "f" * 64, "a" * 16, 2)
    assert resume_problems(kept, _new(data__drop_last=True), "f" * 64, [], source="ckpt", dp=4) == []
    assert resume_problems(run_record(saved, "f" * 64), saved, "f" * 64, [], source="ckpt", dp=4) == []

    notes = validate(compose_config(["data.drop_last=false", "trainer.devices=2", "strategy=ddp"])).notes
    assert any("data.drop_last=false" in note and "dp=2" in note for note in notes), notes
    assert not any("drop_last" in n for n in validate(compose_config(["trainer.devices=2", "strategy=ddp"])).notes)


def test_a_lora_run_resumes_only_on_the_base_its_adapters_were_trained_on() -> None:
    """A LoRA checkpoint holds adapters only; the resume reloads the base from model.init_from. Another
    base (the base run's newer checkpoint) is refused, naming the recorded one; the same base, or a
    full fine-tune's changed init_from (its weights are in the checkpoint), resumes."""
    lora = {**SAVED, "strategy": {"lora": {"rank": 8}}}
    lora["model"] = {**SAVED["model"], "init_from": "/runs/base/checkpoints/step_0000020"}
    moved = {**lora, "model": {**lora["model"], "init_from": "/runs/base/checkpoints/step_0000024"}}
    (problem,) = resume_problems(run_record(lora, "f" * 64), moved, "f" * 64, [], source="ckpt")
    assert "LoRA adapters were trained on that base" in problem
    assert "model.init_from='/runs/base/checkpoints/step_0000020'" in problem
    assert resume_problems(run_record(lora, "f" * 64), lora, "f" * 64, [], source="ckpt") == []
    full = {k: v for k, v in lora.items() if k != "strategy"}
    moved_full = {k: v for k, v in moved.items() if k != "strategy"}
    assert resume_problems(run_record(full, "f" * 64), moved_full, "f" * 64, [], source="ckpt") == []


def test_a_changed_model_names_a_new_run_from_these_weights() -> None:
    """Another model or objective field: resume with the saved value, or a new run_dir that starts from
    the checkpoint's weights (model.init_from), as the docs promise."""
    (problem,) = resume_problems(run_record(SAVED, "f" * 64), _new(model__dim=128), "f" * 64, [], source="ckpt")
    assert problem.endswith(
        "resume with model.dim=64, or start a new run_dir (model.init_from=ckpt starts it from these weights)"
    )


def test_a_tokenizer_trained_again_on_changed_data_is_part_of_the_data_problem() -> None:
    """A resume on rewritten data files with the tokenizer trained from them (data.tokenizer null) said the
    tokenizer differs as a second problem, whose fix (data.tokenizer=<run>/tokenizer.json) alone does not help."""
    record = run_record(SAVED, "t" * 64, data_fingerprint="a" * 64)
    (problem,) = resume_problems(record, _new(), "u" * 64, [], source="ckpt", data_fingerprint="b" * 64)
    assert "the training data differs" in problem and "the tokenizer differs too" in problem
    given = _new(data__tokenizer="/r/tokenizer.json")  # a tokenizer of the user's own: a second, separate fix
    problems = resume_problems(record, given, "u" * 64, [], source="ckpt", data_fingerprint="b" * 64)
    assert len(problems) == 2 and "data.tokenizer=<run>/tokenizer.json" in problems[1]


def test_resuming_another_recipes_run_says_which_recipes(tmp_path) -> None:
    """plait sft run_dir=<a pretrain run> resume=last listed 'resume with data._target_=...' lines (turn
    the sft into a pretrain) without saying the run was a pretrain run."""
    from omegaconf import OmegaConf

    from trainer.config import ConfigError
    from trainer.resume import RECORD_KEY, check_resume

    ckpt = tmp_path / "run" / "checkpoints" / "step_0000001"
    ckpt.mkdir(parents=True)
    torch.save({RECORD_KEY: run_record({**SAVED, "recipe": "pretrain"}, "f" * 64)}, ckpt / "meta.pt")
    new = _new(model__dim=128, optim__lr=1e-3, seed=1, data__seq_len=32)
    with pytest.raises(ConfigError) as err:
        check_resume(OmegaConf.create({**new, "recipe": "sft"}), ckpt)
    assert f"({tmp_path / 'run'} is a pretrain run, this a sft one)" in err.value.problems[0]
