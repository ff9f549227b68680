"""Countdown for Guided-ReST (`trainer.rest.sos`, `trainer.rest.guidance`): problems and their
solutions, the searcher's traces, the verifier's refusals, and the seed claim "every guided trace
is valid and ends at the optimum" over a few hundred problems, judged by a checker written here."""

from __future__ import annotations

import random
import re

import pytest

from trainer.rest.guidance import guide
from trainer.rest.sos import make_problem, search_trace, solve, verify


def replay(trace: str, numbers: list[int], target: int) -> list[str] | None:
    """An independent reading of a trace: the operations from the root to its goal line, or None
    when a line is wrong. Arithmetic by Python's own operators on the state the trace is in."""
    nodes = {"0": (sorted(numbers), [])}
    lines = trace.rstrip("\n").split("\n")
    if lines[0] != f"Current State: {target}:{numbers}, Operations: []":
        return None
    here, i = "0", 1
    while i < len(lines):
        nums, ops = nodes[here]
        line = lines[i]
        if line.startswith("Moving to Node #"):
            name = line.removeprefix("Moving to Node #")
            if name not in nodes:
                return None
            want_nums, want_ops = nodes[name]
            state = re.fullmatch(rf"Current State: {target}:\[([\d, ]*)\], Operations: \[(.*)\]", lines[i + 1])
            if not state or sorted(int(x) for x in state[1].split(", ")) != want_nums:
                return None
            if [o.strip("'") for o in state[2].split(", ") if o] != want_ops:
                return None
            here, i = name, i + 2
            continue
        explore = re.fullmatch(r"Exploring Operation: (\d+)([-+*/])(\d+)=(\d+), Resulting Numbers: \[([\d, ]*)\]", line)
        if not explore:
            return None
        a, sym, b, c = int(explore[1]), explore[2], int(explore[3]), int(explore[4])
        exact = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[sym]
        if exact != c or c <= 0 or a < b:
            return None
        left = list(nums)
        for n in (a, b):
            if n not in left:
                return None
            left.remove(n)
        after = sorted([*left, c])
        if sorted(int(x) for x in explore[5].split(", ")) != after:
            return None
        op = f"{a}{sym}{b}={c}"
        if len(after) == 1:
            if lines[i + 1] == f"{c},{target} equal: Goal Reached":
                return [*ops, op] if c == target and i + 2 == len(lines) else None
            if lines[i + 1] != f"{c},{target} unequal: No Solution" or c == target:
                return None
            i += 2
            continue
        generated = re.fullmatch(r"Generated Node #([\d,]+): .*", lines[i + 1])
        if not generated or generated[1] in nodes:
            return None
        nodes[generated[1]] = (after, [*ops, op])
        i += 2
    return None


def test_a_problem_is_solved_by_its_own_solution_in_count_minus_one_operations():
    rng = random.Random(0)
    for _ in range(200):
        p = make_problem(rng, count=rng.choice([3, 4]), high=12, max_target=60)
        assert len(p["solution"]) == len(p["numbers"]) - 1
        assert 2 <= p["target"] <= 60 and p["target"] not in p["numbers"]
        assert solve(p["numbers"], p["target"]) is not None


def test_the_searchers_solved_traces_verify_and_replay_to_the_target():
    rng = random.Random(1)
    solved = 0
    for _ in range(150):
        p = make_problem(rng, count=3, high=12, max_target=60)
        text, ok = search_trace(p["numbers"], p["target"], breadth=3, max_explored=40)
        verdict = verify(text, p["numbers"], p["target"])
        assert verdict.valid, verdict.problem
        assert verdict.solved == ok
        if ok:
            solved += 1
            assert replay(text, p["numbers"], p["target"]) == verdict.path
    assert solved > 75  # the searcher finds most 3-number problems within 40 explorations


TRACE = """Current State: 12:[6, 4, 2], Operations: []
Exploring Operation: 6*2=12, Resulting Numbers: [4, 12]
Generated Node #0,0: 12:[4, 12] Operation: 6*2=12
Moving to Node #0,0
Current State: 12:[4, 12], Operations: ['6*2=12']
Exploring Operation: 12-4=8, Resulting Numbers: [8]
8,12 unequal: No Solution
Exploring Operation: 12/4=3, Resulting Numbers: [3]
3,12 unequal: No Solution
"""


@pytest.mark.parametrize(
    "edit",
    [
        ("12-4=8", "12-4=9"),  # wrong arithmetic
        ("Resulting Numbers: [4, 12]", "Resulting Numbers: [5, 12]"),  # wrong numbers left
        ("6*2=12, Resulting", "7*2=14, Resulting"),  # a number the state does not hold
        ("Moving to Node #0,0", "Moving to Node #0,1"),  # a node never generated
        ("Operations: ['6*2=12']", "Operations: ['6*4=24']"),  # a state that is not the node's
        ("8,12 unequal: No Solution", "8,12 equal: Goal Reached"),  # a false goal
        ("12/4=3", "4/12=3"),  # the smaller number first
    ],
)
def test_verify_refuses_a_wrong_line(edit):
    numbers, target = [6, 4, 2], 12
    assert verify(TRACE, numbers, target).valid and not verify(TRACE, numbers, target).solved
    bad = TRACE.replace(*edit, 1)
    assert bad != TRACE
    verdict = verify(bad, numbers, target)
    assert not verdict.valid and not verdict.solved, edit
    assert replay(bad, numbers, target) is None


def test_verify_refuses_lines_after_the_goal_and_judges_a_cut_line_unsolved():
    numbers, target = [6, 4, 2], 8
    solved = TRACE.replace("8,12 unequal: No Solution", "8,8 equal: Goal Reached").replace("12:", "8:")
    head = solved.split("Exploring Operation: 12/4")[0]
    assert verify(head, numbers, target).solved
    assert verify(head, numbers, target).path == ["6*2=12", "12-4=8"]
    assert not verify(head + "Exploring Operation: 12/4=3, Resulting Numbers: [3]\n", numbers, target).valid
    cut = head.rsplit("Goal", 1)[0]  # the budget ran out mid-line
    assert verify(cut, numbers, target).valid and not verify(cut, numbers, target).solved


def _model_like(p: dict, rng: random.Random) -> str:
    """What a model might write: a searcher trace cut anywhere, with a wrong line at times."""
    text, _ = search_trace(
        p["numbers"], p["target"], breadth=rng.choice([1, 2, 3]), max_explored=rng.choice([2, 6, 20])
    )
    text = text[: rng.randrange(len(text) + 1)]
    if rng.random() < 0.3 and "\n" in text:
        text = text[: text.rindex("\n") + 1] + "Exploring Operation: 99+1=7, Resulting Numbers: [7]\n"
    return text


def test_every_guided_trace_is_valid_and_ends_at_the_optimum():
    """The seed claim, over 400 problems of 3 and 4 numbers: guidance that inserts the solution's
    next landmark, repeated with nothing written by the model in between, ends after at most
    ``count - 1`` insertions in a trace the independent replay accepts, whose path to the goal has
    ``count - 1`` operations (the optimum)."""
    rng = random.Random(2)
    for _ in range(400):
        p = make_problem(rng, count=rng.choice([3, 4]), high=10, max_target=80)
        text = _model_like(p, rng)
        for _ in range(len(p["numbers"]) - 1):
            if verify(text, p["numbers"], p["target"]).solved:
                break
            text = guide(text, p, rng)
        verdict = verify(text, p["numbers"], p["target"])
        assert verdict.valid and verdict.solved, (p, text, verdict.problem)
        path = replay(text, p["numbers"], p["target"])
        assert path is not None and len(path) == len(p["numbers"]) - 1, (p, text)


def test_a_cut_line_that_begins_no_trace_line_is_invalid():
    """A trace cut by the budget is judged on its complete lines, but its cut line must be the start
    of a trace line: a degenerate model's 192 colons (no newline) counted as a valid trace, so a
    round of them reported 'valid 1.000' (a new user's walkthrough)."""
    numbers, target = [6, 4, 2], 8
    root = "Current State: 8:[6, 4, 2], Operations: []\n"
    for junk in (":" * 192, "hello world", "", "Current State: 99:[6, 4, 2], Ope"):
        assert not verify(junk, numbers, target).valid, junk
    assert not verify(root + "::::", numbers, target).valid
    for junk in (root + "1" + ":" * 191, root + "12 12 12 12", "Current State: 8:[6 4 2], Operations: []"):
        assert not verify(junk, numbers, target).valid, junk  # a fresh reviewer's: digits, a malformed first line
    for cut in ("Current St", root + "Exploring Oper", root + "Exploring Operation: 6*2=12, Resul"):
        assert verify(cut, numbers, target).valid, cut
