"""Search traces sampled from a round's model, with or without landmark guidance, and the
held-out solve rate at a fixed generation budget (`trainer.rest.driver`).

A trace is the model's answer to a problem's prompt (rendered by the run's chat template, as its
SFT data was), decoded up to its EOS or ``max_new_tokens``, and judged by
`trainer.rest.sos.verify`. Every trace has its own sampling seed (`trainer.rl.rollout.completion_seed`
of the run's seed, the round, the problem and the sample; guidance continuations have their own),
so a resumed round samples the same traces. Guided sampling (`sample_traces` with
``guidance_iterations`` > 0) hands each unsolved trace to `trainer.rest.guidance.guide` and lets the
model continue the guided text, up to that many times, as the authors' generation loop does: a
guided text that already fills the budget is not continued.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from torch import nn

from trainer.batch_sampling import sample_batch
from trainer.data.answer_end import turn_end_ids
from trainer.data.chat import JinjaTemplate
from trainer.data.tokenizer import Tokenizer
from trainer.rest.guidance import guide
from trainer.rest.sos import verify
from trainer.rl.rollout import completion_seed


def prompt_message(problem: dict) -> str:
    """The user turn of a problem."""
    return f"Countdown: make {problem['target']} from {problem['numbers']} with + - * /"


@dataclass
class Trace:
    """One sampled trace: the problem's index, the sample's, the text after the prompt, its tokens
    (generated or guided), the guidance iterations it took, and `verify`'s verdict."""

    problem: int
    sample: int
    text: str
    tokens: int
    guided: int
    valid: bool
    solved: bool

    def record(self) -> dict:
        return asdict(self)


class Generator:
    """Decodes traces of problems with one model (`trainer.batch_sampling.sample_batch`, KV cache).

    Args:
        model: the round's model, in eval mode.
        tokenizer: its run's tokenizer.
        template: its run's chat template (`trainer.export.trained_chat_template`).
        batch_rows: traces decoded at once.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, template: JinjaTemplate, *, batch_rows: int = 256
    ) -> None:
        self.model, self.tokenizer, self.template, self.batch_rows = model, tokenizer, template, batch_rows
        self.stops = (tokenizer.eos_id, *turn_end_ids(tokenizer, template))

    def prompt_ids(self, problem: dict) -> list[int]:
        text = self.template.render([{"role": "user", "content": prompt_message(problem)}], add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def decode(
        self, prompts: Sequence[list[int]], budgets: Sequence[int], *, temperature: float, seeds: Sequence[int]
    ) -> list[list[int]]:
        """Each prompt's continuation, at most its budget of tokens (and what the model's context
        leaves after its own prompt), without the EOS or end of turn (`trainer.data.answer_end.turn_end_ids`)
        that ended it."""
        out: list[list[int]] = [[] for _ in prompts]
        for rows in self._batches(prompts, budgets):
            longest = max(len(prompts[i]) for i in rows)
            new = min(max(budgets[i] for i in rows), self.model.max_seq_len - longest)
            ids = sample_batch(
                self.model,
                [prompts[i] for i in rows],
                max_new_tokens=new,
                eos_id=self.tokenizer.eos_id,
                stop_ids=self.stops,
                temperature=temperature,
                seeds=[seeds[i] for i in rows],
                device=next(self.model.parameters()).device,
            )
            for i, row in zip(rows, ids):
                row = row[: budgets[i]]  # each row decodes alone: cutting it is stopping it there
                out[i] = row[:-1] if row and row[-1] in self.stops else row
        return out

    def _batches(self, prompts: Sequence[list[int]], budgets: Sequence[int]) -> list[list[int]]:
        """Rows decoded together: like prompt lengths share a batch (shortest first), of at most
        ``batch_rows``, and a batch closes before a longer prompt would cut another row's decode
        (a batch decodes ``max_seq_len - its longest prompt`` tokens at most, left-padded)."""
        limit = self.model.max_seq_len
        batches: list[list[int]] = []
        need = 0  # the most tokens a row of the open batch decodes alone
        for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
            own = max(0, min(budgets[i], limit - len(prompts[i])))
            if not batches or len(batches[-1]) >= self.batch_rows or max(need, own) + len(prompts[i]) > limit:
                batches.append([])
                need = 0
            batches[-1].append(i)
            need = max(need, own)
        return batches


def sample_traces(
    gen: Generator,
    problems: Sequence[dict],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    round_index: int,
    guidance_iterations: int = 0,
) -> list[Trace]:
    """``samples`` traces of every problem (problem-major order), guided up to
    ``guidance_iterations`` times each (0: plain ReST, the model's own traces)."""
    keys = [(i, j) for i in range(len(problems)) for j in range(samples)]
    prompts = {i: gen.prompt_ids(p) for i, p in enumerate(problems)}
    ids = gen.decode(
        [prompts[i] for i, _ in keys],
        [max_new_tokens] * len(keys),
        temperature=temperature,
        seeds=[completion_seed(seed, round_index, i, j) for i, j in keys],
    )
    texts = [gen.tokenizer.decode(row) for row in ids]
    tokens = [len(row) for row in ids]
    guided = [0] * len(keys)
    for it in range(1, guidance_iterations + 1):
        todo = []
        for k, (i, j) in enumerate(keys):
            if verify(texts[k], problems[i]["numbers"], problems[i]["target"]).solved:
                continue
            text = guide(texts[k], problems[i], random.Random(completion_seed(seed, round_index, i, samples * it + j)))
            used = len(gen.tokenizer.encode(text))
            if used >= max_new_tokens:  # the guided text alone fills the budget: the trace stays unsolved
                continue
            texts[k], tokens[k], guided[k] = text, used, it
            if not verify(text, problems[i]["numbers"], problems[i]["target"]).solved:
                todo.append(k)
        if not todo:
            continue
        more = gen.decode(
            [prompts[keys[k][0]] + gen.tokenizer.encode(texts[k]) for k in todo],
            [max_new_tokens - tokens[k] for k in todo],
            temperature=temperature,
            seeds=[completion_seed(seed, round_index, keys[k][0], samples * it + keys[k][1]) for k in todo],
        )
        for k, row in zip(todo, more):
            texts[k] += gen.tokenizer.decode(row)
            tokens[k] += len(row)
    out = []
    for k, (i, j) in enumerate(keys):
        verdict = verify(texts[k], problems[i]["numbers"], problems[i]["target"])
        out.append(Trace(i, j, texts[k], tokens[k], guided[k], verdict.valid, verdict.solved))
    return out


def keep(traces: Sequence[Trace], *, max_per_problem: int) -> list[Trace]:
    """The traces to train on: valid and solved, deduplicated per problem, the shortest
    ``max_per_problem`` of each problem (ties in sample order)."""
    by_problem: dict[int, dict[str, Trace]] = {}
    for t in traces:
        if t.valid and t.solved:
            by_problem.setdefault(t.problem, {}).setdefault(t.text, t)
    out = []
    for i in sorted(by_problem):
        out += sorted(by_problem[i].values(), key=lambda t: (t.tokens, t.sample))[:max_per_problem]
    return out


def solve_rates(gen: Generator, problems: Sequence[dict], budgets: Sequence[int]) -> dict:
    """The greedy traces of ``problems`` and the share solved within each budget (generated tokens):
    ``{"solve_rate": {budget: share}, "valid": share, "legal_lines": mean lines before the first
    wrong one, "mean_tokens": ..., "traces": [...]}``.

    Greedy decoding makes a shorter budget's trace a prefix of a longer one's, so one decode at
    the largest budget gives every budget's rate.
    """
    top = max(budgets)
    ids = gen.decode(
        [gen.prompt_ids(p) for p in problems], [top] * len(problems), temperature=0.0, seeds=[0] * len(problems)
    )
    verdicts = [verify(gen.tokenizer.decode(row), p["numbers"], p["target"]) for row, p in zip(ids, problems)]
    n = max(len(problems), 1)
    return {
        "solve_rate": {str(b): sum(v.solved and len(row) <= b for v, row in zip(verdicts, ids)) / n for b in budgets},
        "valid": sum(v.valid for v in verdicts) / n,
        # how far the model writes the search language before its first wrong line (a partial credit
        # that moves long before whole traces are right)
        "legal_lines": sum(gen.tokenizer.decode(row)[: v.prefix].count("\n") for v, row in zip(verdicts, ids)) / n,
        "mean_tokens": sum(len(row) for row in ids) / n,
        "traces": [
            {"problem": i, "text": gen.tokenizer.decode(row), "tokens": len(row), "solved": v.solved}
            for i, (row, v) in enumerate(zip(ids, verdicts))
        ],
    }
