"""Landmark guidance (Guided-ReST, Moon, Park and Song, NeurIPS 2025): a failed search trace is
cut where it last followed the known solution and given that solution's next step, and the model
continues its own search from there.

The landmarks are the states of the solution (`trainer.rest.sos.make_problem`'s ``solution``):
after its first ``d`` operations the numbers are ``apply_op`` of them. `subgoal_nodes` finds the
deepest chain of them that the trace explored (each a child of the one before, moved to and
stated); `guide` then inserts the next one:

- the last operation: the trace is cut after the deepest node's state and ends with the
  operation and its goal line (a complete, solved trace);
- the landmark was generated under the deepest node but never visited: the trace is cut after
  its generation and moves to it;
- the deepest node has no visited child: the landmark is generated as its first child and visited;
- else one visited child, drawn at random, is replaced by the landmark (its generation rewritten,
  what came between kept) and the trace moves to it, so the guided trace keeps the model's own
  search before that point.

Only the trace's legal head is kept (`trainer.rest.sos.verify`'s ``prefix``: the lines before the
first wrong or cut one); a trace without one starts from the root state. The authors' code
(snu-mllab/guided-rest, ``recipe/countdown/core_algos.py``) was read for where the landmarks go;
this is plait's own implementation on `trainer.rest.sos`'s format.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from trainer.rest.sos import apply_op, explore_line, generated_line, leaf_line, move_line, state_line, verify


@dataclass(frozen=True)
class Node:
    """A visited node of a trace: its name, numbers and operations, and where (character offsets)
    its generation lines (``gen_start:gen_end``, empty for the root) and its move and state lines
    (``expl_start:expl_end``) lie."""

    name: str
    nums: list[int]
    ops: list[str]
    gen_start: int
    gen_end: int
    expl_start: int
    expl_end: int


def _generation(name: str, target: int, nums: list[int], op: str) -> str:
    return f"{explore_line(op, nums)}\n{generated_line(name, target, nums, op)}\n"


def _visit(name: str, target: int, nums: list[int], ops: list[str]) -> str:
    return f"{move_line(name)}\n{state_line(target, nums, ops)}\n"


def subgoal_nodes(trace: str, problem: dict) -> list[Node]:
    """The root and the solution's states the trace visited in a chain (empty: no root state)."""
    target, nums, ops = problem["target"], list(problem["numbers"]), []
    root = state_line(target, nums, ops) + "\n"
    if not trace.startswith(root):
        return []
    nodes = [Node("0", nums, ops, 0, 0, 0, len(root))]
    for op in problem["solution"][:-1]:
        parent = nodes[-1]
        nums, ops = apply_op(nums, op), [*ops, op]
        gen = re.compile(re.escape(explore_line(op, nums)) + r"\n" + _generated_pattern(parent.name, target, nums, op))
        found = gen.search(trace, parent.expl_end)
        if found is None:
            break
        name = found[1]
        visit = trace.find(_visit(name, target, nums, ops), found.end())
        if visit < 0:
            break
        nodes.append(
            Node(name, nums, ops, found.start(), found.end(), visit, visit + len(_visit(name, target, nums, ops)))
        )
    return nodes


def _generated_pattern(parent: str, target: int, nums: list[int], op: str) -> str:
    return rf"Generated Node #({re.escape(parent)},\d+): {re.escape(f'{target}:{nums}')} Operation: {re.escape(op)}\n"


def _children(trace: str, parent: Node) -> list[tuple[str, int, int, int]]:
    """``(name, gen_start, gen_end, expl_start)`` of each visited child the trace generated under ``parent``."""
    gen = re.compile(r"Exploring Operation: [^\n]*\n" + rf"Generated Node #({re.escape(parent.name)},\d+): [^\n]*\n")
    out = []
    for found in gen.finditer(trace, parent.expl_end):
        visit = trace.find(f"{move_line(found[1])}\n", found.end())
        if visit >= 0:
            out.append((found[1], found.start(), found.end(), visit))
    return out


def guide(trace: str, problem: dict, rng: random.Random) -> str:
    """The trace with the solution's next landmark inserted (see the module docstring): the text
    the model continues from, or a complete solved trace when the landmark is the last step.

    Args:
        trace: the model's trace (its text after the prompt), any text.
        problem: ``{"numbers", "target", "solution"}`` (`trainer.rest.sos.make_problem`).
        rng: draws the visited child to replace.
    """
    target = problem["target"]
    trace = trace[: verify(trace, problem["numbers"], target).prefix]  # the legal head, cut between two steps
    if not trace:
        trace = state_line(target, list(problem["numbers"]), []) + "\n"
    parent = subgoal_nodes(trace, problem)[-1]
    op = problem["solution"][len(parent.ops)]
    nums, ops = apply_op(parent.nums, op), [*parent.ops, op]
    head = trace[: parent.expl_end]
    if len(nums) == 1:
        return f"{head}{explore_line(op, nums)}\n{leaf_line(nums[0], target)}\n"
    pending = re.compile(re.escape(explore_line(op, nums)) + r"\n" + _generated_pattern(parent.name, target, nums, op))
    found = pending.search(trace, parent.expl_end)
    if found is not None:
        return trace[: found.end()] + _visit(found[1], target, nums, ops)
    children = _children(trace, parent)
    if not children:
        name = f"{parent.name},0"
        return head + _generation(name, target, nums, op) + _visit(name, target, nums, ops)
    name, gen_start, gen_end, expl_start = children[rng.randrange(len(children))]
    return (
        trace[:gen_start]
        + _generation(name, target, nums, op)
        + trace[gen_end:expl_start]
        + _visit(name, target, nums, ops)
    )
