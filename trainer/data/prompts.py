"""`PromptDataModule`: prompts and the fields their rewards need, for online RL (`plait grpo`).

Each entry of ``sources`` is one named source of prompts::

    sources:
      addition: {source: addition, limit: 2000, val_size: 64}    # a synthetic task
      mine: {source: data/prompts.jsonl, val_size: 32}           # a table of your own

A synthetic task (trainer.data.synthetic: copy, reversal, sorting, addition, countdown) gives
``{"prompt", "answer"}`` (countdown also ``numbers`` and ``target``). A user's table (jsonl, json,
parquet, arrow, csv, shards or a save_to_disk folder: trainer.data.tables) has a ``prompt``
column, text (one user turn) or a list of chat messages (TRL's prompt-only format); every other
column is a field handed to the reward functions by its name. ``columns`` renames columns, as
for SFT.

Prompts are rendered by the run's chat template up to the assistant's turn (``template``, as
SFT renders them, so a policy fine-tuned by ``plait sft`` sees the prompts it was trained on) and
tokenized. A rollout row is the prompt, then its completion, then padding, ``seq_len`` tokens:
prompts longer than ``seq_len - completion_len`` are dropped, counted and printed (refused when
a source keeps none).

The train loader hands each dp rank the indices of its prompts of every step (a
`GlobalBatchSampler`, resumable like every plait loader); the G completions of one prompt are
sampled on the rank that holds it, so a group is never split across ranks. Each prompt batch is
handed ``num_iterations`` times in a row (``batch["iteration"]``: 0 .. num_iterations - 1), one
optimizer step each (`trainer.objectives.grpo`). Held out per source: ``val_size`` prompts, whose
greedy completions the rewards score at each evaluation (`trainer.rl.evaluate.RewardEvaluator`:
``val/reward``, ``val/reward/<name>``), and, where the prompt has a text ``answer``, the NLL of
that answer (``val/loss``, nats per answer token).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Unpack, override

from trainer.data import synthetic
from trainer.data.base import DataError, DataModule, Settings, named_source_problems
from trainer.data.cache import fingerprint
from trainer.data.chat import JinjaTemplate, Message, prompt_text
from trainer.data.formats import FormatError, messages
from trainer.data.loader import Batch, Position, RowBatches
from trainer.data.packing import IGNORE_INDEX
from trainer.data.sampler import GlobalBatchSampler
from trainer.data.sources import Catalog
from trainer.data.tokenizer import Tokenizer
from trainer.protocols import Evaluator, RowKind
from trainer.rl.evaluate import PromptItem, RewardEvaluator
from trainer.rl.rewards import Reward, RewardError, build_rewards, missing_fields, unaccepted_fields
from trainer.rl.rewards import node_problems as reward_problems


def prompt_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A prompt record of a user's row: ``{"prompt": [messages], <other columns>}``.

    Raises:
        FormatError: no ``prompt`` column, or one that is neither text nor chat messages.
    """
    if "prompt" not in row:
        raise FormatError(
            f"has fields {sorted(row)}; a prompt table needs a 'prompt' column (text, or a list of "
            "{role, content} messages) and the columns its rewards read (e.g. 'answer'); rename with data.sources.<name>.columns"
        )
    return {**{k: v for k, v in row.items() if k != "prompt"}, "prompt": messages(row["prompt"], "prompt", role="user")}


def _synthetic_prompts(task: str, *, seed: int, sizes: dict[str, int]) -> dict[str, list]:
    def user(text: str) -> list[Message]:
        return [{"role": "user", "content": text}]

    if task == "countdown":
        made = synthetic.distinct_splits(task, synthetic.countdown_problem, seed=seed, sizes=sizes)
        return {
            split: [{"prompt": user(p), "answer": a, "numbers": n, "target": t} for p, a, n, t in items]
            for split, items in made.items()
        }
    made = synthetic.examples(task, seed=seed, sizes=sizes)
    return {split: [{"prompt": user(p), "answer": a} for p, a in items] for split, items in made.items()}


PROMPTS = Catalog(
    bundled={},
    synthetic=dict.fromkeys(synthetic.TASKS, _synthetic_prompts),
    parse_row=prompt_row,
    example="addition.source=addition",
)


@dataclass
class PreparedPrompts:
    """Tokenizer, chat template and the rendered, tokenized prompts of both splits."""

    tokenizer: Tokenizer
    template: JinjaTemplate | None
    train: list[PromptItem]
    val: list[PromptItem]
    dropped: dict[str, int] = field(default_factory=dict)  # per source: training prompts too long


class RepeatedBatches:
    """A `RowBatches` stream whose every batch is handed ``times`` times in a row, each with
    ``batch["iteration"]`` (one value per row: 0 .. times - 1). Its position counts handed-out
    batches (``{"epoch", "trained"}``, trained = repeats done), so a run resumes in the middle of
    a prompt batch's repeats too."""

    def __init__(self, inner: RowBatches, times: int) -> None:
        self.inner, self.times = inner, times

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def start(self) -> Position:
        return self.inner.start()

    def batches(self, position: Position) -> Iterator[tuple[Batch, Position, bool]]:
        first = position["trained"] if position["epoch"] == self.inner.sampler.epoch else 0
        first = first if first < self.num_batches(position) else 0
        inner_start = {"epoch": self.inner.sampler.epoch, "trained": first // self.times}
        skip = first % self.times
        for batch, inner_position, last in self.inner.batches(inner_start):
            for repeat in range(skip, self.times):
                rows = len(next(iter(batch.values())))
                done = (inner_position["trained"] - 1) * self.times + repeat + 1
                out = {**batch, "iteration": torch.full((rows,), repeat, dtype=torch.long)}
                yield out, {"epoch": inner_position["epoch"], "trained": done}, last and repeat == self.times - 1
            skip = 0

    def num_batches(self, position: Position) -> int:
        return self.inner.num_batches(position) * self.times

    def restore(self, state: Position) -> Position:
        epoch, trained = state["epoch"], state["trained"]
        if trained >= self.num_batches(state):
            epoch, trained = epoch + 1, 0
        self.inner.sampler.set_epoch(epoch)
        return {"epoch": epoch, "trained": trained}

    def exhausted(self, position: Position) -> bool:
        return False

    def metrics(self, position: Position) -> dict[str, float]:
        return {}


class PromptDataModule(DataModule):
    """Prompts for online RL (see module docstring).

    Args:
        sources: name -> ``{source, limit, val_size, columns}``.
        rewards: name -> ``{fn, weight}`` (`trainer.rl.rewards`; Hydra has built each ``fn``).
        template: "auto", "default" or "tokenizer" (as `trainer.data.sft.SFTDataModule`).
        group_size: completions per prompt (set from ``objective.num_generations``): the global
            batch of ``train.global_batch_size`` rows holds global_batch_size / group_size prompts.
        completion_len: tokens per completion at most (set from ``objective.max_new_tokens``).
        num_iterations: optimizer steps per prompt batch (set from ``objective.num_iterations``).
        stop: strings that end a completion (set from ``objective.stop``): the held-out greedy
            completions are cut as the training ones are.
        **settings: ``seq_len`` (prompt + completion + padding), ``tokenizer``, ``vocab_size``,
            ``seed``, ``cache_dir``, ``run`` (`DataModule`).

    Raises:
        DataError: a problem of `node_problems`.
    """

    catalog = PROMPTS  # the names of data.sources.<name>.source it reads as synthetic tasks

    row_kind: RowKind = "prompts"

    def __init__(
        self,
        *,
        sources: dict[str, dict[str, Any]],
        rewards: dict[str, dict[str, Any]],
        template: str = "auto",
        group_size: int = 8,
        completion_len: int = 16,
        num_iterations: int = 1,
        stop: Sequence[str] = (),
        **settings: Unpack[Settings],
    ) -> None:
        super().__init__(**settings)
        node = {"sources": sources, "rewards": rewards, "group_size": group_size, "completion_len": completion_len,
                "seq_len": self.seq_len, "num_iterations": num_iterations}  # fmt: skip
        if problems := self.node_problems(node):
            raise DataError("; ".join(problems))
        self.sources = {name: PROMPTS.parse(name, dict(spec or {})) for name, spec in sources.items()}
        self.reward_nodes = rewards
        self.template_name = template
        self.group_size, self.completion_len, self.num_iterations = group_size, completion_len, num_iterations
        self.stop = tuple(stop)
        self.prompts_per_step = self.global_batch_size // group_size
        self._rewards: list[Reward] | None = None

    @override
    @classmethod
    def node_problems(cls, node: Any) -> list[str]:
        """The sources, the rewards' targets, and the room a completion has in a row."""
        problems = named_source_problems(node, lambda name, spec: PROMPTS.parse(name, spec), PROMPTS.empty_problem())
        rewards = node.get("rewards") if hasattr(node, "get") else None
        shape = reward_problems(rewards)
        problems += shape
        if not shape:  # build them now: a target that does not import is found before any process starts
            try:
                build_rewards(rewards)
            except RewardError as err:
                problems.append(str(err))
        seq_len, completion = node.get("seq_len", 0), node.get("completion_len", 0)
        if isinstance(seq_len, int) and isinstance(completion, int) and seq_len and completion >= seq_len:
            problems.append(
                f"objective.max_new_tokens={completion} leaves no room for a prompt in data.seq_len={seq_len}; "
                f"raise data.seq_len (e.g. data.seq_len={completion + 64}) or lower objective.max_new_tokens"
            )
        return problems

    @override
    @classmethod
    def problems(cls, run: Any, node: Any) -> list[str]:
        problems = super().problems(run, node)
        group = node.get("group_size", 1)
        if run is not None and isinstance(group, int) and group > 0:
            gbs, dp = run.global_batch_size, run.dims.dp
            if gbs % group or (gbs // group) % dp:
                problems.append(
                    f"train.global_batch_size={gbs} completions must be a multiple of objective.num_generations={group} "
                    f"x dp={dp} ranks (a prompt's group is never split across ranks); e.g. train.global_batch_size="
                    f"{group * dp * max(1, gbs // (group * dp))}"
                )
        return problems

    # ------------------------------------------------------------------------------ preparation
    @override
    def _prepare(self) -> PreparedPrompts:
        """Tokenizer, template and the tokenized prompts (synthetic prompts are regenerated: cheap).

        Raises:
            DataError: an unreadable table, a source whose prompts are all too long.
        """
        records = {name: PROMPTS.records(source, seed=self.seed) for name, source in self.sources.items()}
        texts = [
            m["content"] + " " + str(r.get("answer", ""))
            for train, _ in records.values()
            for r in train
            for m in r["prompt"]
        ]
        tokenizer = self.load_tokenizer(texts, fingerprint("prompts", *texts))
        template = self.chat_template(self.template_name, tokenizer)
        room = self.seq_len - self.completion_len
        train, val, dropped, problems = [], [], {}, []
        for name, (train_records, val_records) in records.items():
            kept = [self._item(name, r, tokenizer, template) for r in train_records]
            long = sum(len(item.ids) > room for item in kept)
            if long:
                dropped[name] = long
                print(
                    f"plait: data.sources.{name}: dropped {long} of {len(kept)} training prompts longer than "
                    f"data.seq_len - objective.max_new_tokens = {room} tokens",
                    file=sys.stderr,
                )
            if long == len(kept):
                shortest = min(len(item.ids) for item in kept)
                problems.append(
                    f"data.sources.{name}: every prompt is longer than data.seq_len - objective.max_new_tokens = "
                    f"{room} tokens (the shortest has {shortest}); raise data.seq_len to at least "
                    f"{shortest + self.completion_len}"
                )
            train += [item for item in kept if len(item.ids) <= room]
            held_out = [self._item(name, r, tokenizer, template) for r in val_records]
            if long_val := sum(len(item.ids) > room for item in held_out):
                print(
                    f"plait: data.sources.{name}: dropped {long_val} of {len(held_out)} held-out prompts longer than "
                    f"{room} tokens",
                    file=sys.stderr,
                )
            val += [item for item in held_out if len(item.ids) <= room]
        if not problems and len(train) < self.prompts_per_step:
            problems.append(
                f"{len(train)} training prompts, but a step takes train.global_batch_size / objective.num_generations "
                f"= {self.global_batch_size} / {self.group_size} = {self.prompts_per_step}; add prompts, or lower "
                "train.global_batch_size"
            )
        columns = {name for item in train + val for name in item.fields}
        for reward in self.rewards:
            if missing := missing_fields(reward.fn, columns):
                problems.append(
                    f"data.rewards.{reward.name}: its function needs {', '.join(missing)}, which neither its fn node "
                    f"nor the prompts' columns ({', '.join(sorted(columns)) or 'none'}) give; add "
                    f"{'them' if len(missing) > 1 else 'it'} to fn (+data.rewards.{reward.name}.fn.{missing[0]}=...) "
                    "or as a column of the prompts' table"
                )
            if unaccepted := unaccepted_fields(reward.fn, columns):
                problems.append(
                    f"data.rewards.{reward.name}: its function is called with the prompts' columns as keyword "
                    f"arguments and takes no {', '.join(unaccepted)}; add **fields to its parameters "
                    "(def reward(prompts, completions, **fields))"
                )
        if problems:
            raise DataError("; ".join(problems))
        return PreparedPrompts(tokenizer=tokenizer, template=template, train=train, val=val, dropped=dropped)

    @staticmethod
    def _item(source: str, record: dict[str, Any], tokenizer: Tokenizer, template: JinjaTemplate | None) -> PromptItem:
        turns = record["prompt"]
        text = prompt_text(turns) if template is None else template.render(turns, add_generation_prompt=True)
        fields = {k: v for k, v in record.items() if k != "prompt"}
        return PromptItem(source=source, text=text, ids=tokenizer.encode(text), fields=fields)

    # ------------------------------------------------------------------------------ what the objective reads
    def prompt_items(self, indices: Sequence[int]) -> list[PromptItem]:
        """The training prompts at ``indices`` (the loader's ``batch["prompt_index"]``)."""
        train = self.prepare().train
        return [train[i] for i in indices]

    @property
    def rewards(self) -> list[Reward]:
        """The run's reward functions (`trainer.rl.rewards.build_rewards`), built once.

        Raises:
            DataError: a reward that cannot be built (its message names the fix).
        """
        if self._rewards is None:
            try:
                self._rewards = build_rewards(self.reward_nodes)
            except RewardError as err:
                raise DataError(str(err)) from None
        return self._rewards

    # ------------------------------------------------------------------------------ loaders
    @override
    def train_batches(self, dp_rank: int, dp_size: int) -> RepeatedBatches:
        sampler = GlobalBatchSampler(
            len(self.prepare().train),
            global_batch_size=self.prompts_per_step,
            dp_rank=dp_rank,
            dp_size=dp_size,
            shuffle=True,
            seed=self.seed,
        )
        rows = {"prompt_index": torch.arange(len(self.prepare().train))}
        return RepeatedBatches(RowBatches(rows, sampler), self.num_iterations)

    @override
    def eval_rows(self) -> dict[str, Tensor]:
        """Held-out prompt + answer rows (answers that are text), labels on the answer and its end:
        the EOS under plait's default template, the end of turn a tokenizer's template writes
        (`trainer.data.chat.JinjaTemplate.turn_end`: ``<|im_end|>\\n``; it never writes the EOS)."""
        prepared = self.prepare()
        tok = prepared.tokenizer
        end = [tok.eos_id] if prepared.template is None else tok.encode(prepared.template.turn_end())
        rows = []
        for item in prepared.val:
            answer = item.fields.get("answer")
            if not isinstance(answer, str):
                continue
            ids = (item.ids + tok.encode(answer) + end)[: self.seq_len]
            labels = [IGNORE_INDEX] * (len(item.ids) - 1) + ids[len(item.ids) :] + [IGNORE_INDEX]
            rows.append((ids, labels[: len(ids)]))
        input_ids = torch.full((len(rows), self.seq_len), tok.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for i, (ids, labs) in enumerate(rows):
            input_ids[i, : len(ids)], labels[i, : len(labs)] = torch.tensor(ids), torch.tensor(labs)
        return {"input_ids": input_ids, "labels": labels}

    @override
    def evaluators(self) -> list[Evaluator]:
        prepared = self.prepare()
        if not prepared.val:
            return []
        return [
            RewardEvaluator(
                prepared.val,
                self.rewards,
                prepared.tokenizer,
                max_new_tokens=self.completion_len,
                stop=(*self.stop, *self.stop_texts()),
                stop_ids=self.stop_ids(),
            )
        ]

    @property
    @override
    def noun(self) -> str:
        return "prompts"
