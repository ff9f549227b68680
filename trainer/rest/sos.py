"""Countdown search traces in the Stream-of-Search format: the problem generator with its known
solution, the symbolic searcher that writes a trace, and the verifier of a trace.

Stream of Search (Gandhi et al., "Stream of Search (SoS): Learning to Search in Language", 2024)
trains a model on a search written out as text; Guided-ReST (Moon, Park and Song, NeurIPS 2025)
starts from such a model. A trace is lines of five kinds (``T`` the target, ``[..]`` the numbers
left, ``a+b=c`` one operation)::

    Current State: 24:[4, 6, 2], Operations: []
    Exploring Operation: 6*4=24, Resulting Numbers: [2, 24]
    Generated Node #0,0: 24:[2, 24] Operation: 6*4=24
    Moving to Node #0,0
    Current State: 24:[2, 24], Operations: ['6*4=24']
    Exploring Operation: 24-2=22, Resulting Numbers: [22]
    22,24 unequal: No Solution
    Exploring Operation: 24/2=12, Resulting Numbers: [12]
    ...
    24,24 equal: Goal Reached

An operation takes two numbers of the state (the larger first), removes them and appends the
result: ``a+b``, ``a-b`` (a > b), ``a*b`` and ``a/b`` (b divides a); results are positive
integers, as in SoS. Node names are paths: the root is ``0``, its children ``0,0``, ``0,1``...

Every solution uses ``count - 1`` operations, so the generator's own solution is an optimal one;
its intermediate states are the landmarks Guided-ReST inserts (`trainer.rest.guidance`).
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass, field

NUM = r"\d+"
LIST = r"\[[\d, ]*\]"
OP = rf"({NUM})([-+*/])({NUM})=({NUM})"
STATE_RE = re.compile(rf"Current State: ({NUM}):({LIST}), Operations: (\[[^\]]*\])")
EXPLORE_RE = re.compile(rf"Exploring Operation: {OP}, Resulting Numbers: ({LIST})")
GENERATED_RE = re.compile(rf"Generated Node #([\d,]+): ({NUM}):({LIST}) Operation: ({NUM}[-+*/]{NUM}={NUM})")
MOVE_RE = re.compile(r"Moving to Node #([\d,]+)")
LEAF_RE = re.compile(rf"({NUM}),({NUM}) (equal: Goal Reached|unequal: No Solution)")
GOAL = "equal: Goal Reached"


def state_line(target: int, nums: list[int], ops: list[str]) -> str:
    return f"Current State: {target}:{nums}, Operations: {ops}"


def explore_line(op: str, nums: list[int]) -> str:
    return f"Exploring Operation: {op}, Resulting Numbers: {nums}"


def generated_line(name: str, target: int, nums: list[int], op: str) -> str:
    return f"Generated Node #{name}: {target}:{nums} Operation: {op}"


def move_line(name: str) -> str:
    return f"Moving to Node #{name}"


def leaf_line(value: int, target: int) -> str:
    return f"{value},{target} {GOAL}" if value == target else f"{value},{target} unequal: No Solution"


def _result(a: int, symbol: str, b: int) -> int | None:
    if symbol == "+":
        return a + b
    if symbol == "-":
        return a - b if a > b else None
    if symbol == "*":
        return a * b
    return a // b if b and a % b == 0 else None


def apply_op(nums: list[int], op: str) -> list[int]:
    """The numbers after ``op`` (``"a+b=c"``): ``a`` and ``b`` removed, ``c`` appended.

    Raises:
        ValueError: ``op`` is malformed, wrong, not allowed (a <= b for -, inexact /), or uses a
            number that ``nums`` does not hold.
    """
    match = re.fullmatch(OP, op)
    if match is None:
        raise ValueError(f"not an operation: {op!r}")
    a, symbol, b, c = int(match[1]), match[2], int(match[3]), int(match[4])
    if _result(a, symbol, b) != c:
        raise ValueError(f"{op}: {a}{symbol}{b} is not {c} (or not allowed)")
    rest = list(nums)
    for n in (a, b):
        if n not in rest:
            raise ValueError(f"{op}: {n} is not among {nums}")
        rest.remove(n)
    return [*rest, c]


def legal_ops(nums: list[int]) -> list[str]:
    """Every operation on two of ``nums`` (pairs by position, the larger number first)."""
    out = []
    for i in range(len(nums)):
        for j in range(i + 1, len(nums)):
            a, b = max(nums[i], nums[j]), min(nums[i], nums[j])
            for symbol in "+-*/":
                c = _result(a, symbol, b)
                if c is not None and c > 0:
                    out.append(f"{a}{symbol}{b}={c}")
    return out


def solve(numbers: list[int], target: int) -> list[str] | None:
    """One solution (``count - 1`` operations, an optimal one), or None when there is none."""
    if len(numbers) == 1:
        return [] if numbers[0] == target else None
    for op in legal_ops(numbers):
        rest = solve(apply_op(numbers, op), target)
        if rest is not None:
            return [op, *rest]
    return None


def make_problem(rng: random.Random, *, count: int = 3, high: int = 20, max_target: int = 100) -> dict:
    """A problem ``{"numbers", "target", "solution"}`` whose solution is the operations it was made by.

    Difficulty: ``count`` numbers drawn from ``[1, high]``; random legal operations combine them
    until one number is left, which is the target if it lies in ``[2, max_target]`` and is not
    one of the numbers (else the draw repeats).
    """
    while True:
        numbers = [rng.randint(1, high) for _ in range(count)]
        nums, solution = list(numbers), []
        while len(nums) > 1:
            op = rng.choice(legal_ops(nums))
            solution.append(op)
            nums = apply_op(nums, op)
        if 2 <= nums[0] <= max_target and nums[0] not in numbers:
            return {"numbers": numbers, "target": nums[0], "solution": solution}


def heuristic(nums: list[int], target: int) -> int:
    """How far a state looks from the target: the distance of its closest number (smaller first)."""
    return min(abs(target - n) for n in nums)


def search_trace(numbers: list[int], target: int, *, breadth: int = 3, max_explored: int = 40) -> tuple[str, bool]:
    """The trace of a heuristic depth-first search (the SoS symbolic searcher), and whether it
    reached the target.

    At each node the legal operations are ordered by `heuristic` of their result; at most
    ``breadth`` of them are generated as children (all written first, as SoS does), then visited
    in that order, each subtree before the next. The last two numbers try every operation. The search stops at the goal or after
    ``max_explored`` "Exploring Operation" lines (then the trace ends unsolved).
    """
    lines = [state_line(target, numbers, [])]
    explored = 0

    def visit(name: str, nums: list[int], ops: list[str]) -> bool:
        nonlocal explored
        candidates = sorted(legal_ops(nums), key=lambda op: heuristic(apply_op(nums, op), target))
        if len(nums) > 2:
            candidates = candidates[:breadth]
        children = []
        for op in candidates:
            if explored >= max_explored:
                return False
            explored += 1
            after = apply_op(nums, op)
            lines.append(explore_line(op, after))
            if len(after) == 1:
                lines.append(leaf_line(after[0], target))
                if after[0] == target:
                    return True
                continue
            child = f"{name},{len(children)}"
            lines.append(generated_line(child, target, after, op))
            children.append((child, after, [*ops, op]))
        for child, after, child_ops in children:
            lines.extend([move_line(child), state_line(target, after, child_ops)])
            if visit(child, after, child_ops):
                return True
        return False

    solved = visit("0", list(numbers), [])
    return "\n".join(lines) + "\n", solved


@dataclass
class Verdict:
    """What `verify` found: ``valid`` (every complete line legal), ``solved`` (a legal goal line
    ends it), the operations of the path that reached the goal, and the first problem."""

    valid: bool
    solved: bool
    path: list[str] = field(default_factory=list)
    problem: str | None = None
    prefix: int = 0  # characters of the trace's legal head that ends between two steps (guidance cuts there)


def _ops_list(text: str) -> list[str]:
    value = ast.literal_eval(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a list of operations: {text}")
    return value


LINE_HEADS = ("Current State: ", "Exploring Operation: ", "Generated Node #", "Moving to Node #")
LEAF_ENDS = ("equal: Goal Reached", "unequal: No Solution")


def _could_begin(line: str) -> bool:
    """Whether a line cut off by the generation budget could be the start of a trace line past the
    first: a start of one of `LINE_HEADS` or past one, or of a leaf line (``a,b equal: Goal Reached``
    or ``unequal: No Solution``), not, e.g., a run of colons or of numbers."""
    if any(head.startswith(line) or line.startswith(head) for head in LINE_HEADS):
        return True
    m = re.fullmatch(r"-?\d*(?:,(-?\d*)(?: (.*))?)?", line)
    return m is not None and (m[2] is None or any(end.startswith(m[2]) for end in LEAF_ENDS))


def verify(trace: str, numbers: list[int], target: int) -> Verdict:
    """Checks a trace line by line against the problem (never raises).

    Legal: the root state first; an exploration applies a legal operation to the current state's
    numbers and states the result; it is followed by its generated node (a new child of the
    current node) or, when one number is left, its leaf line; a move goes to a generated node not
    visited yet and is followed by that node's state. A solved trace ends at its goal line; a
    trace cut short (its last line incomplete, and that line the start of a trace line) is judged
    on its complete lines and is unsolved; a cut line that could begin no trace line is wrong.
    ``prefix`` is the end of the legal lines before the first wrong or cut one, where no
    exploration or move waits for its second line.
    """
    nodes: dict[str, tuple[list[int], list[str]]] = {"0": (list(numbers), [])}
    visited, current, pending = {"0"}, "0", None  # pending: what the previous line requires next
    lines = list(enumerate(trace.rstrip("\n").split("\n")))
    complete = trace.endswith("\n")

    settled = 0  # the end of the last line after which no second line is pending

    def bad(i: int, why: str) -> Verdict:
        return Verdict(False, False, problem=f"line {i + 1}: {why}", prefix=settled)

    offset = 0
    for i, line in lines:
        last = i == len(lines) - 1
        if pending is None:
            settled = offset
        offset += len(line) + 1
        try:
            if i == 0:
                m = STATE_RE.fullmatch(line)
                if not m or int(m[1]) != target or ast.literal_eval(m[2]) != list(numbers) or _ops_list(m[3]):
                    cut = (
                        not complete and last and bool(line) and state_line(target, list(numbers), []).startswith(line)
                    )
                    return Verdict(True, False, prefix=0) if cut else bad(i, "the first line is not the root state")
                continue
            nums, ops = nodes[current]
            if pending is not None:
                kind, data = pending
                pending = None
                if kind == "after_explore":
                    op, after = data
                    if len(after) == 1:
                        m = LEAF_RE.fullmatch(line)
                        if (
                            not m
                            or int(m[1]) != after[0]
                            or int(m[2]) != target
                            or (m[3] == GOAL) != (after[0] == target)
                        ):
                            raise ValueError("not the leaf line of the exploration")
                        if m[3] == GOAL:
                            if not last:
                                raise ValueError("lines after the goal")
                            return Verdict(True, True, path=[*ops, op], prefix=len(trace))
                        continue
                    m = GENERATED_RE.fullmatch(line)
                    if not m or int(m[2]) != target or ast.literal_eval(m[3]) != after or m[4] != op:
                        raise ValueError("not the generated node of the exploration")
                    name = m[1]
                    if name in nodes or name.rsplit(",", 1)[0] != current:
                        raise ValueError(f"node #{name} is not a new child of #{current}")
                    nodes[name] = (after, [*ops, op])
                    continue
                if kind == "after_move":
                    m = STATE_RE.fullmatch(line)
                    want_nums, want_ops = nodes[data]
                    if (
                        not m
                        or int(m[1]) != target
                        or ast.literal_eval(m[2]) != want_nums
                        or _ops_list(m[3]) != want_ops
                    ):
                        raise ValueError(f"not the state of node #{data}")
                    current = data
                    continue
            if m := EXPLORE_RE.fullmatch(line):
                op = f"{m[1]}{m[2]}{m[3]}={m[4]}"
                after = apply_op(nums, op)
                if ast.literal_eval(m[5]) != after:
                    raise ValueError(f"{op} on {nums} leaves {after}")
                pending = ("after_explore", (op, after))
                continue
            if m := MOVE_RE.fullmatch(line):
                if m[1] not in nodes or m[1] in visited:
                    raise ValueError(f"node #{m[1]} was not generated or was visited")
                visited.add(m[1])
                pending = ("after_move", m[1])
                continue
            raise ValueError("not a trace line")
        except (ValueError, SyntaxError) as err:
            root = state_line(target, list(numbers), [])
            cut = root.startswith(line) if i == 0 else _could_begin(line)
            if last and not complete and line and cut:  # cut off mid-line by the generation budget
                return Verdict(True, False, prefix=settled)
            return bad(i, str(err))
    if pending is None and complete:
        settled = len(trace)
    return Verdict(True, False, prefix=settled)
