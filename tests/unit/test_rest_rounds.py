"""One ReST round's data without a model (`trainer.rest.rollouts`, `trainer.rest.driver`): a scripted
generator stands in for the policy, so what the guided and the unguided arm keep is known; the
driver's options are refused with their fix."""

from __future__ import annotations

import random
import re

import pytest

from trainer.config import ConfigError
from trainer.rest.driver import GuidedReST
from trainer.rest.problems import problems
from trainer.rest.rollouts import Trace, keep, sample_traces
from trainer.rest.run_dir import check_run_dir
from trainer.rest.sos import search_trace, verify


class CharTokenizer:
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedGenerator:
    """First answers: a searcher trace cut short (some solved, some wrong); continuations after
    guidance: nothing (the model stops at once), so what a guided trace holds is guidance's."""

    def __init__(self, problem_list: list[dict]) -> None:
        self.tokenizer, self.problems = CharTokenizer(), problem_list
        self.calls = 0

    def prompt_ids(self, problem: dict) -> list[int]:
        return [1000 + self.problems.index(problem)]

    def decode(self, prompts, budgets, *, temperature, seeds):
        self.calls += 1
        out = []
        for prompt, budget, seed in zip(prompts, budgets, seeds):
            if len(prompt) > 1:  # a continuation of a guided text
                out.append([])
                continue
            p, rng = self.problems[prompt[0] - 1000], random.Random(seed)
            text, _ = search_trace(
                p["numbers"], p["target"], breadth=rng.choice([1, 3]), max_explored=rng.choice([3, 40])
            )
            if rng.random() < 0.3:
                text = text.replace("Exploring Operation: ", "Exploring Operation: 1", 1)  # a wrong line
            out.append(self.tokenizer.encode(text)[:budget])
        return out


def test_the_guided_arm_keeps_only_valid_solved_traces_and_solves_more():
    train, _ = problems(3, train=120, held_out=0, count=3, high=10, max_target=50)
    common = dict(samples=2, max_new_tokens=4000, temperature=1.0, seed=0, round_index=1)
    plain = sample_traces(ScriptedGenerator(train), train, guidance_iterations=0, **common)
    guided = sample_traces(ScriptedGenerator(train), train, guidance_iterations=2, **common)
    for a, b in zip(plain, guided, strict=True):  # the same seeds: the same first answers
        assert (a.problem, a.sample) == (b.problem, b.sample)
        assert b.guided or a.text == b.text
    assert sum(t.solved for t in guided) > sum(t.solved for t in plain)
    assert any(t.guided for t in guided)
    for t in keep(guided, max_per_problem=2):
        p = train[t.problem]
        verdict = verify(t.text, p["numbers"], p["target"])
        assert verdict.valid and verdict.solved and t.valid and t.solved
        assert len(verdict.path) == len(p["numbers"]) - 1
    assert {t.problem for t in keep(guided, max_per_problem=1)} == set(range(120))  # two landmarks solve any


def test_keep_drops_unsolved_and_duplicates_and_keeps_the_shortest():
    traces = [
        Trace(0, 0, "long", 30, 0, True, True),
        Trace(0, 1, "short", 10, 1, True, True),
        Trace(0, 2, "short", 10, 0, True, True),  # a duplicate text
        Trace(0, 3, "mid", 20, 0, True, True),
        Trace(1, 0, "wrong", 5, 0, False, False),
        Trace(1, 1, "unsolved", 5, 0, True, False),
    ]
    assert [(t.problem, t.sample) for t in keep(traces, max_per_problem=2)] == [(0, 1), (0, 3)]


def test_held_out_problems_are_not_training_problems():
    train, held_out = problems(0, train=300, held_out=100, count=3, high=10, max_target=50)
    key = lambda p: (tuple(sorted(p["numbers"])), p["target"])
    assert len({key(p) for p in train + held_out}) == 400
    with pytest.raises(ConfigError, match="distinct problems found of the 500 asked for"):
        problems(0, train=400, held_out=100, count=3, high=4, max_target=20)


@pytest.mark.parametrize(
    ("change", "fix"),
    [
        ({"arms": ["guided", "greedy"]}, "rest.arms"),
        ({"init": "first"}, "rest.init"),
        ({"budgets": [64, 999]}, "rest.max_new_tokens"),
        ({"samples": 0}, "rest.samples"),
        ({"steps": 0}, "rest.steps"),
    ],
)
def test_bad_options_are_refused_with_their_fix(change, fix):
    args = dict(problems={"train": 10, "held_out": 5}, searcher={}, max_new_tokens=256, budgets=[64, 256])
    with pytest.raises(ConfigError, match=fix.replace(".", r"\.")):
        GuidedReST(**{**args, **change})


def test_a_run_directory_with_rounds_needs_resume_and_resume_needs_rounds(tmp_path):
    from omegaconf import OmegaConf

    (tmp_path / "old" / "round_0").mkdir(parents=True)
    with pytest.raises(ConfigError, match="continue it with resume=last"):
        check_run_dir(OmegaConf.create({"resume": None}), tmp_path / "old")
    with pytest.raises(ConfigError, match="holds no ReST round to resume"):
        check_run_dir(OmegaConf.create({"resume": "last"}), tmp_path / "new")
    with pytest.raises(ConfigError, match="resumes its own run directory"):
        check_run_dir(OmegaConf.create({"resume": "runs/x"}), tmp_path / "old")
    check_run_dir(OmegaConf.create({"resume": "last"}), tmp_path / "old")
    OmegaConf.save({"resume": None, "rest": {"samples": 4}}, tmp_path / "old" / "config.yaml")
    check_run_dir(OmegaConf.create({"resume": "last", "rest": {"samples": 4}}), tmp_path / "old")
    with pytest.raises(ConfigError, match=r"rest\.samples: 4 when .* started, 2 now") as err:
        check_run_dir(OmegaConf.create({"resume": "last", "rest": {"samples": 2}}), tmp_path / "old")
    assert (
        err.value.problems[-1]
        == f"plait resume {tmp_path / 'old'} continues it with the config it started with, nothing typed again"
    )


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("rest.max_new_tokens=600", "raise data.seq_len to at least 664"),
        ("rest.problems.train=5000", "lower rest.problems.train"),
        ("+rest.problems.size=4", "rest.problems.size: not a difficulty knob"),
        ("rest.init=first", "rest.init=first"),
    ],
)
def test_validate_refuses_a_rest_run_before_any_run_directory(override, fix):
    from harness import compose_config

    from trainer.config import validate

    validate(compose_config([], recipe="rest", tiny=False))
    with pytest.raises(ConfigError, match=re.escape(fix)):
        validate(compose_config([override], recipe="rest", tiny=False))


def test_a_resume_compares_a_recorded_relative_path_as_the_file_it_names(tmp_path, monkeypatch):
    """A ReST run started before paths were made absolute recorded ``data.tokenizer`` as typed; the
    resume's config holds it absolute (`trainer.data.config_paths.absolute_paths`): the same file, no refusal."""
    from omegaconf import OmegaConf

    tmp_path = tmp_path.resolve()
    (tmp_path / "old" / "round_0").mkdir(parents=True)
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "other.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    OmegaConf.save({"resume": None, "data": {"tokenizer": "tok.json"}}, tmp_path / "old" / "config.yaml")
    check_run_dir(
        OmegaConf.create({"resume": "last", "data": {"tokenizer": str(tmp_path / "tok.json")}}), tmp_path / "old"
    )
    with pytest.raises(ConfigError, match=r"data\.tokenizer: tok\.json when .* started, .*other\.json now"):
        check_run_dir(
            OmegaConf.create({"resume": "last", "data": {"tokenizer": str(tmp_path / "other.json")}}), tmp_path / "old"
        )


def test_a_long_prompt_never_cuts_another_traces_decode() -> None:
    """`Generator.decode` batches traces by prompt length; a batch decodes at most
    ``max_seq_len - its longest prompt`` tokens, so a short prompt with a large budget must not share
    a batch with a long one. Each row decodes as much as alone (no EOS in a vocabulary of 16: every
    row runs its whole budget). Mutation: batching by length alone cuts the short row to 10."""
    import torch

    from trainer.models.llama import Llama
    from trainer.rest.rollouts import Generator

    torch.manual_seed(0)
    model = Llama(vocab_size=16, dim=16, n_layers=1, n_heads=2, max_seq_len=40).eval()

    class Tok:
        eos_id = 99  # never sampled

    gen = Generator(model, Tok(), template=None)
    short, long_ = [1] * 5, [1] * 30
    together = gen.decode([short, long_], [30, 5], temperature=1.0, seeds=[1, 2])
    assert [len(row) for row in together] == [30, 5]
    assert together[0] == gen.decode([short], [30], temperature=1.0, seeds=[1])[0]  # as alone
    # a prompt that leaves less than its budget decodes what the context leaves, batched or not
    assert [len(row) for row in gen.decode([[1] * 35, short], [30, 4], temperature=1.0, seeds=[3, 1])] == [5, 4]
