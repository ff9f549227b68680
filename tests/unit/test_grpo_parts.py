"""The pieces of plait's online RL around the loss (tests/unit/test_grpo_loss.py) and the sampler
(tests/unit/test_sample_batch.py): Countdown's verifier, the reward functions and their errors, the
rollout rows, the prompt data and its repeated batches, what validate refuses, and a LoRA run
whose KL term reads the base with the adapters off."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch
from harness import compose_config, fit, plait

from trainer.build import build_data
from trainer.config import ConfigError, validate
from trainer.data.base import DataError
from trainer.data.countdown import check, make
from trainer.data.loader import RowBatches
from trainer.data.prompts import RepeatedBatches
from trainer.data.sampler import GlobalBatchSampler
from trainer.rl import evaluate
from trainer.rl.evaluate import PromptItem
from trainer.rl.rewards import RewardError, build_rewards, exact_answer, format_match, length_penalty, score
from trainer.rl.rollout import completion_seed, cut_at_stop, rollout_rows

GRPO_SMALL = (
    "model=nano", "model.max_seq_len=64", "data.seq_len=48", "data.sources.addition.limit=64",
    "data.sources.addition.val_size=8", "objective.max_new_tokens=6", "objective.num_generations=4",
    "train.global_batch_size=16", "train.eval_every=0", "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false", "logger=none", "~callbacks.plots", "~callbacks.checkpoint",
)  # fmt: skip


# ------------------------------------------------------------------------------------------ Countdown
def test_countdown_solutions_verify_and_other_answers_do_not() -> None:
    rng = random.Random(0)
    for _ in range(500):
        problem = make(rng)
        assert check(problem["solution"], problem["numbers"], problem["target"])
        assert problem["target"] >= 1 and len(problem["numbers"]) == 3
    assert check("(3 - 2) * 5 = 5", [3, 2, 5], 5)  # an "= target" after the expression is ignored
    assert not check("5", [3, 2, 5], 5)  # every number once
    assert not check("(3 - 2) * 5 * 1", [3, 2, 5], 5)  # a number that was not given
    assert not check("3 * 3 - 2 - 2", [3, 2, 5], 5)  # a number twice
    assert not check("__import__('os').system('true')", [1], 1)  # never evaluated
    assert not check("5 / (3 - 3) + 2", [5, 3, 3, 2], 2)  # division by zero is just wrong
    assert not check("", [1], 1)


# ------------------------------------------------------------------------------------------ rewards
def test_shipped_rewards() -> None:
    assert exact_answer(["p", "p"], [" 4 2 ", "4 3"], ["4 2", "4 2"]) == [1.0, 0.0]
    assert format_match(["p", "p"], ["1 2", "1 a"], pattern="[0-9 ]+") == [1.0, 0.0]
    assert length_penalty(["p", "p"], ["ab", "abcdef"], limit=3) == [0.0, -1.0]


def test_rewards_are_built_from_nodes_and_user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, completions, **fields):\n    return [-len(c) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = build_rewards({
        "answer": {"fn": {"_target_": "trainer.rl.rewards.exact_answer", "_partial_": True}, "weight": 1.0},
        "short": {"fn": {"_target_": "my_rewards.brevity", "_partial_": True}, "weight": 0.5},
    })  # fmt: skip
    values = score(rewards, ["p", "p"], ["1", "22"], {"answer": ["1", "1"]})
    assert values == {"answer": [1.0, 0.0], "short": [-1.0, -2.0]}
    sys.modules.pop("my_rewards", None)


def test_reward_problems_name_the_fix() -> None:
    with pytest.raises(RewardError, match="data.rewards is empty"):
        build_rewards({})
    with pytest.raises(RewardError, match=r"data.rewards.mine needs fn: \{_target_"):
        build_rewards({"mine": {"_target_": "trainer.rl.rewards.exact_answer", "weight": 1.0}})
    with pytest.raises(RewardError, match="not a function; add _partial_: true"):
        build_rewards({"mine": {"fn": {"_target_": "builtins.dict"}}})
    short = build_rewards({"x": {"fn": lambda prompts, completions, **f: [1.0]}})
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        score(short, ["a", "b"], ["a", "b"], {})
    none = build_rewards({"x": {"fn": lambda prompts, completions, **f: [None] * len(completions)}})
    with pytest.raises(RewardError, match=r"returned \[None\]; return one float per completion"):
        score(none, ["a"], ["a"], {})
    narrow = build_rewards({"x": {"fn": lambda prompts, completions: [1.0] * len(completions)}})
    with pytest.raises(RewardError, match=r"raised TypeError.*take \*\*fields"):
        score(narrow, ["a"], ["a"], {"answer": ["1"]})
    nan = build_rewards({"x": {"fn": lambda prompts, completions, **f: [float("nan")] * len(completions)}})
    with pytest.raises(RewardError, match="not finite"):
        score(nan, ["a"], ["a"], {})


# ------------------------------------------------------------------------------------------ rollout rows
def test_rollout_rows_put_the_completion_tokens_in_the_labels() -> None:
    rows = rollout_rows([[5, 6, 7], [8]], [[1, 2, 0], []], width=6, pad_id=9)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 1, 2, 0], [8, 9, 9, 9, 9, 9]]
    # labels[t] is the token at t + 1 where that token is the completion's (EOS 0 included)
    assert rows["labels"].tolist() == [[-100, -100, 1, 2, 0, -100], [-100] * 6]
    with pytest.raises(ValueError, match="exceeds 3"):
        rollout_rows([[1, 2]], [[3, 4]], width=3, pad_id=0)


def test_stop_strings_cut_after_the_token_that_completes_them() -> None:
    class Chars:  # one character per id
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    ids = [ord(c) for c in "ab;cd"]
    assert cut_at_stop(ids, Chars(), [";"]) == ids[:3]
    assert cut_at_stop(ids, Chars(), ["x"]) == ids
    assert cut_at_stop(ids, Chars(), []) == ids


def test_completion_seeds_depend_on_the_prompt_not_the_rank() -> None:
    seeds = {completion_seed(0, r, p, g) for r in range(3) for p in range(5) for g in range(4)}
    assert len(seeds) == 60 and all(0 <= s < 2**63 for s in seeds)
    assert completion_seed(0, 1, 2, 3) == completion_seed(0, 1, 2, 3) != completion_seed(1, 1, 2, 3)


# ------------------------------------------------------------------------------------------ prompt data
def test_repeated_batches_hand_each_prompt_batch_num_iterations_times_and_resume_inside() -> None:
    rows = {"prompt_index": torch.arange(12)}
    stream = RepeatedBatches(RowBatches(rows, GlobalBatchSampler(12, global_batch_size=4, seed=0)), 3)
    got = [
        (b["prompt_index"].tolist(), int(b["iteration"][0]), p["trained"]) for b, p, _ in stream.batches(stream.start())
    ]
    assert len(got) == 9 and [g[1] for g in got] == [0, 1, 2] * 3 and [g[2] for g in got] == list(range(1, 10))
    assert got[0][0] == got[1][0] == got[2][0] != got[3][0]
    resumed = [
        (b["prompt_index"].tolist(), int(b["iteration"][0])) for b, _, _ in stream.batches({"epoch": 0, "trained": 4})
    ]
    assert resumed == [(g[0], g[1]) for g in got[4:]]
    assert stream.restore({"epoch": 0, "trained": 9}) == {"epoch": 1, "trained": 0}


def test_a_user_prompt_table_keeps_its_columns_for_the_rewards(tmp_path: Path) -> None:
    table = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"what is {i} + {i}?", "answer": str(2 * i), "difficulty": i % 3} for i in range(20)]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_config(
        [*GRPO_SMALL, "~data.sources.addition", f"+data.sources.mine={{source: {table}, val_size: 4}}"],
        recipe="grpo",
        tiny=False,
    )
    data = build_data(cfg)
    items = data.prepare().train
    assert len(items) == 16 and len(data.prepare().val) == 4
    assert {"answer", "difficulty"} == set(items[0].fields) and items[0].text.startswith("<|user|>")
    assert data.eval_rows()["input_ids"].shape == (4, 48)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x", "answer": "1"}) + "\n")
    cfg = compose_config(
        [*GRPO_SMALL, "~data.sources.addition", f"+data.sources.mine={{source: {bad}}}"], recipe="grpo", tiny=False
    )
    with pytest.raises(DataError, match="needs a 'prompt' column"):
        build_data(cfg).prepare()


def test_a_reward_whose_argument_no_column_gives_is_refused_when_the_data_is_prepared(tmp_path: Path) -> None:
    """format_match needs 'pattern': from its fn node or a column. A new user's table without one
    failed at the first step with a TypeError and a hint about **fields."""
    table = tmp_path / "prompts.jsonl"
    table.write_text("".join(json.dumps({"prompt": f"{i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(20)))
    reward = "+data.rewards.fmt={fn: {_target_: trainer.rl.rewards.format_match, _partial_: true}, weight: 0.5}"
    common = [*GRPO_SMALL, "~data.sources.addition", f"+data.sources.mine={{source: {table}, val_size: 4}}", reward]
    cfg = compose_config(common, recipe="grpo", tiny=False)
    with pytest.raises(DataError, match=r"data.rewards.fmt: its function needs pattern, which neither its fn node nor "
                       r"the prompts' columns \(answer\) give; add it to fn \(\+data.rewards.fmt.fn.pattern=...\)"):  # fmt: skip
        build_data(cfg).prepare()
    given = compose_config([*common, "+data.rewards.fmt.fn.pattern='[0-9]+'"], recipe="grpo", tiny=False)
    assert len(build_data(given).prepare().train) == 16


def test_a_reward_that_cannot_take_the_columns_is_refused_when_the_data_is_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every column is passed by name: a function without **fields (a reviewer's
    ``no_kwargs(prompts, completions)``) failed at the first step, after its run directory was written."""
    (tmp_path / "user_rewards.py").write_text(
        "def no_kwargs(prompts, completions):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = "+data.rewards.mine={fn: {_target_: user_rewards.no_kwargs, _partial_: true}, weight: 0.5}"
    cfg = compose_config([*GRPO_SMALL, reward], recipe="grpo", tiny=False)
    with pytest.raises(DataError, match=r"data.rewards.mine: its function is called with the prompts' columns as "
                       r"keyword arguments and takes no answer; add \*\*fields"):  # fmt: skip
        build_data(cfg).prepare()


# ------------------------------------------------------------------------------------------ validate
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["strategy=tp", "trainer.devices=2"], r"objective GRPO samples whole sequences .* strategy.tp=2"),
        (["objective.beta=0.04"], r"objective.beta=0.04 needs a reference policy.*\+strategy/lora=default"),
        (["strategy=diloco", "trainer.devices=2"], "objective GRPO under local SGD"),
        (["train.global_batch_size=10"], r"multiple of objective.num_generations=4 x dp=1"),
        (
            ["strategy=ddp", "trainer.devices=2", "train.global_batch_size=4"],
            r"multiple of objective.num_generations=4 x dp=2",
        ),
        (["objective.num_generations=1"], "objective.num_generations must be >= 2"),
        (["objective.max_new_tokens=48"], "leaves no room for a prompt in data.seq_len=48"),
    ],
)
def test_validate_refuses_what_grpo_cannot_run(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(compose_config([*GRPO_SMALL, *overrides], recipe="grpo", tiny=False))


def test_an_objective_of_token_rows_is_refused_prompts() -> None:
    overrides = [o for o in GRPO_SMALL if not o.startswith("objective.")]
    with pytest.raises(ConfigError, match="trains on token rows, but the data module gives prompts"):
        validate(compose_config([*overrides, "objective=sft"], recipe="grpo", tiny=False))


@pytest.mark.parametrize("objective", ["grpo", "dr_grpo", "dapo", "gspo", "rloo"])
def test_every_variant_validates_and_trains(objective: str, tmp_path: Path) -> None:
    overrides = [
        *GRPO_SMALL, f"objective={objective}", "objective.num_iterations=2", "trainer.max_steps=2",
        "data.rewards.answer.fn._target_=trainer.rl.rewards.length_penalty", "+data.rewards.answer.fn.limit=3",
    ]  # fmt: skip
    cfg = compose_config(overrides, recipe="grpo", tiny=False)
    validate(cfg)
    _, task = fit(cfg, tmp_path)
    steps = [h for h in task.history if "loss" in h]
    # Step 2 reuses step 1's rollout (num_iterations=2); GSPO's tight sequence clip (3e-4) may zero it.
    assert len(steps) == 2 and steps[0]["grad_norm"] > 0, steps
    assert all(abs(h["loss"]) < 1e3 and h["grad_norm"] < 1e3 for h in steps), steps


# ------------------------------------------------------------------------------------------ LoRA + KL
def test_lora_run_takes_its_kl_against_the_base_with_adapters_off(tmp_path: Path) -> None:
    base = tmp_path / "base"  # a checkpoint the adapters train on (one plain GRPO step)
    keep = [o for o in GRPO_SMALL if o != "~callbacks.checkpoint"]
    result = plait("grpo", *keep, "trainer.max_steps=1", f"run_dir={base}")
    assert result.returncode == 0, result.stderr[-3000:]
    overrides = [
        *GRPO_SMALL, "+strategy/lora=default", f"model.init_from={base}", "objective.beta=0.5", "trainer.max_steps=3", "optim.lr=1e-2",
        "data.rewards.answer.fn._target_=trainer.rl.rewards.length_penalty", "+data.rewards.answer.fn.limit=3",
    ]  # fmt: skip
    cfg = compose_config(overrides, recipe="grpo", tiny=False)
    validate(cfg)
    _, task = fit(cfg, tmp_path)
    kl = [h["train/kl"] for h in task.history if "loss" in h]
    # Step 1: the adapters' B is 0, so the policy is the base (KL exactly 0); then the adapters move it.
    assert kl[0] == 0.0 and kl[-1] > 0.0, kl


def test_a_run_without_any_learning_signal_says_so(tmp_path: Path) -> None:
    # A fresh model never writes the exact sum: every group's rewards are equal (all 0).
    result = plait("grpo", *GRPO_SMALL, "trainer.max_steps=10", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the last 10 rollouts gave every group of completions the same reward" in result.stderr
    assert "model.init_from=<an SFT run>" in result.stderr
    # A run shorter than that says it at its last step (a new user's 2-step run said nothing).
    short = plait("grpo", *GRPO_SMALL, "trainer.max_steps=2", f"run_dir={tmp_path / 'short'}")
    assert short.returncode == 0 and "the last 2 rollouts gave every group" in short.stderr, short.stderr[-3000:]


def test_a_reward_target_that_does_not_import_is_refused_by_validate() -> None:
    overrides = [*GRPO_SMALL, "data.rewards.answer.fn._target_=no_such_module.reward"]
    with pytest.raises(ConfigError, match=r"data.rewards.answer.fn: .*no_such_module"):
        validate(compose_config(overrides, recipe="grpo", tiny=False))


def test_a_reward_that_fails_during_the_run_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "bad_rewards.py").write_text(
        "def broken(prompts, completions, **fields):\n    return [None] * len(completions)\n"
    )
    target = "data.rewards.answer.fn._target_=bad_rewards.broken"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = plait("grpo", *GRPO_SMALL, target, "trainer.max_steps=2", f"run_dir={tmp_path / 'run'}", env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "plait: error: data.rewards.answer returned [None" in result.stderr and "Traceback" not in result.stderr
    assert f"nothing was trained; the run directory {tmp_path / 'run'} is removed" in result.stderr
    assert not (tmp_path / "run").exists()  # a failed first step leaves nothing behind, as a refused start


def test_countdown_prompts_train_and_steps_that_reuse_a_rollout_log_its_rewards(tmp_path: Path) -> None:
    overrides = [o for o in GRPO_SMALL if not o.startswith("data.sources.")]
    cfg = compose_config(
        [*overrides, "data=countdown", "data.sources.countdown.limit=64", "data.sources.countdown.val_size=8",
         "objective.num_iterations=2", "trainer.max_steps=2"],
        recipe="grpo", tiny=False,
    )  # fmt: skip
    assert list(cfg.data.sources) == ["countdown"]
    _, task = fit(cfg, tmp_path)
    steps = [h for h in task.history if "loss" in h]
    assert all("train/reward" in h and "train/completion_length" in h for h in steps), steps
    assert steps[0]["train/reward"] == steps[1]["train/reward"]  # step 2 trains on step 1's rows


def test_too_few_prompts_for_one_step_are_refused(tmp_path: Path) -> None:
    cfg = compose_config([*GRPO_SMALL, "data.sources.addition.limit=3"], recipe="grpo", tiny=False)
    with pytest.raises(DataError, match=r"3 training prompts, but a step takes .* = 16 / 4 = 4"):
        build_data(cfg).prepare()


def test_a_mapping_for_data_rewards_replaces_the_presets() -> None:
    given = "data.rewards={short: {fn: {_target_: trainer.rl.rewards.length_penalty, _partial_: true, limit: 3}}}"
    cfg = compose_config([*GRPO_SMALL, given], recipe="grpo", tiny=False)
    assert list(cfg.data.rewards) == ["short"]


def test_every_prompt_too_long_is_refused_naming_the_seq_len_that_fits() -> None:
    cfg = compose_config([*GRPO_SMALL, "data.seq_len=16"], recipe="grpo", tiny=False)
    with pytest.raises(
        DataError,
        match=r"every prompt is longer than .* = 10 tokens \(the shortest has \d+\); raise data.seq_len to at least \d+",
    ):
        build_data(cfg).prepare()


def test_held_out_completions_are_cut_before_the_stop_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    class Chars:  # one character per id
        eos_id = 0

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    item = PromptItem(source="s", text="p", ids=[1], fields={"answer": "12"})
    monkeypatch.setattr(evaluate, "sample_batch", lambda *a, **k: [[ord(c) for c in "12;34"] + [0]])
    answer = build_rewards({"answer": {"fn": exact_answer}})
    cut = evaluate.RewardEvaluator([item], answer, Chars(), max_new_tokens=8, stop=[";"])
    # The stop string is left out of what the rewards read (vLLM's default), so the answer scores.
    assert cut.completions(None, "cpu") == ["12"] and cut.evaluate(None, "cpu")["val/reward"] == 1.0
    assert evaluate.RewardEvaluator([item], answer, Chars(), max_new_tokens=8).completions(None, "cpu") == ["12;34"]


def test_a_reward_that_does_not_import_names_why_before_launch() -> None:
    """A reward module in the current folder is never imported (plait takes --user-path); a
    misspelt function or module got Hydra's 'Error locating target' at the first step, the same for both."""
    from trainer.rl.rewards import node_problems

    def problems(target: str) -> list[str]:
        return node_problems({"r": {"fn": {"_target_": target, "_partial_": True}, "weight": 1.0}})

    (missing,) = problems("no_such_rewards_module.says")
    assert missing.startswith("data.rewards.r.fn: no module 'no_such_rewards_module': plait imports your code from")
    assert "--user-path DIR" in missing
    assert problems("trainer.rl.rewards.exact_answre") == [
        "data.rewards.r.fn: trainer.rl.rewards has no 'exact_answre'; did you mean trainer.rl.rewards.exact_answer?"
    ]
    assert problems("trainer.rl.rewards.exact_answer") == []
    # a reviewer's: a class's method (Hydra builds it) is found; a module that raises on import is said
    assert problems("collections.OrderedDict.fromkeys") == []
    assert problems("trainer.rl.rewards.Reward.nosuch") == [
        "data.rewards.r.fn: trainer.rl.rewards.Reward has no 'nosuch'"
    ]
    assert problems("antigravity_no_such.x.y")[0].startswith("data.rewards.r.fn: no module 'antigravity_no_such.x'")


def test_an_engine_with_its_own_weights_generates_from_the_current_policy(tmp_path: Path) -> None:
    """Before: sync_weights ran at the end of a rollout, before that step's update, so an engine
    holding its own copy (vLLM's) sampled every rollout from the weights one update old (a reviewer's
    copy engine: 0, 1.5e-4, 3.0e-4 from the live policy)."""
    record = tmp_path / "staleness.json"
    engine = f"+objective.engine={{_target_:rl_fixtures.CopyEngine,record:'{record}'}}"
    rewards = ("data.rewards.answer.fn._target_=trainer.rl.rewards.length_penalty", "+data.rewards.answer.fn.limit=3")
    overrides = [*GRPO_SMALL, *rewards, "trainer.max_steps=3", "~objective.engine", engine]
    cfg = compose_config(overrides, recipe="grpo", tiny=False)
    validate(cfg)
    _, task = fit(cfg, tmp_path)
    assert json.loads(record.read_text()) == [0.0, 0.0, 0.0]
    assert all(h["grad_norm"] > 0 for h in task.history if "loss" in h)  # the policy moved between the rollouts
