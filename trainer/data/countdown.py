"""Countdown: reach a target number from given numbers with + - * and parentheses, each number
used exactly once. Every answer can be verified and one solution is known (the expression the
target was made from), which makes it the benchmark of Stream of Search (Gandhi et al. 2024) and
Guided-ReST (Moon et al. 2025), and a common first task of R1-style RL (TinyZero).

`make` draws a problem from a seeded ``random.Random``: ``count`` numbers in ``[1, high]`` and a
target computed from them by a random expression whose intermediate results stay positive
integers (no division: every target is an integer). `check` verifies an answer expression
without ``eval``: it parses the text with Python's `ast` and accepts only numbers, + - * / and
parentheses.
"""

from __future__ import annotations

import ast
import operator
import random
from fractions import Fraction

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def make(rng: random.Random, *, count: int = 3, high: int = 9) -> dict:
    """One problem: ``{"numbers": [...], "target": int, "solution": "..."}``.

    The numbers are combined left to right in a random order with random operators; a step
    that would make a result below 1 uses + instead, so the target is a positive integer.
    """
    numbers = [rng.randint(1, high) for _ in range(count)]
    order = rng.sample(numbers, count)
    value, text = order[0], str(order[0])
    for i, n in enumerate(order[1:], start=2):
        symbol = rng.choice(list(_SYMBOLS))
        if _SYMBOLS[symbol](value, n) < 1:
            symbol = "+"
        value = _SYMBOLS[symbol](value, n)
        text = f"{text} {symbol} {n}" if i == count else f"({text} {symbol} {n})"
    return {"numbers": numbers, "target": value, "solution": text}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not allowed in an answer: {ast.dump(node)[:40]}")


def check(answer: str, numbers: list[int], target: int) -> bool:
    """Whether ``answer`` (an expression, an optional ``= target`` after it is ignored) uses each
    of ``numbers`` exactly once and evaluates to ``target``. Anything else (text, other numbers,
    a number twice, division by zero, a syntax error) is False; never raises."""
    text = answer.split("=")[0].strip()
    if not text or len(text) > 200:
        return False
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(text, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False
    return sorted(used) == sorted(int(n) for n in numbers) and value == target
