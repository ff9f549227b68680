"""`SFTDataModule`: named chat sources -> tokenizer -> budgeted mixture -> packed global batches.

Each entry of ``sources`` is one named source with its budget (trainer.data.mixture)::

    sources:
      math: {source: champ, weight: 1.0, max_tokens: 200000, max_epochs: null, limit: null,
             val_size: 16, metric: loss}

``source`` is a bundled real set (trainer.data.instructions: alpaca, glaive, humaneval, champ,
ifbench), a synthetic task (trainer.data.synthetic: copy, reversal, sorting, addition) or a user's table
(a jsonl/json/parquet/arrow/csv file, shards or a save_to_disk folder in TRL's formats:
trainer.data.sources). ``limit`` caps the training conversations (synthetic: how many are generated,
default 1000); ``val_size`` conversations are held out per source; ``metric`` is the held-out
score for the mSFT controller: ``loss`` (validation loss, lower is better) or ``exact_match``
(greedy decoding of the held-out prompts, higher is better; single-turn sources).

A user's rows follow TRL's rule (trainer.data.formats): conversational rows (message lists) are
rendered with the chat template; standard rows (string ``prompt`` + ``completion``, or ``text``)
are plain text, prompt then completion, loss on the completion and its EOS, no template.
``string_rows: chat`` (per source) renders standard rows as a user and an assistant turn instead,
for string data meant for a chat model (``plait chat`` and ``generate chat=true`` prompt through
the template).

Samples longer than ``seq_len`` follow ``long_samples``: ``split`` (continue in the next rows;
no token is lost, but each piece is a document of its own, so the tokens of a later piece train
without seeing the sample's start, its prompt included; case C29), ``truncate`` (keep the first
``seq_len`` tokens), ``drop`` (leave the sample out) or ``error``. Whatever is cut or split is
counted per source (trainer.data.accounting: printed at launch, a warning above 5% of a source, in
``summary.json``, refused when a source keeps no supervised token) and logged as
``train/dropped_tokens/<source>``; no supervised token is cut or split uncounted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from typing_extensions import Unpack, override

from trainer.data import accounting, encode
from trainer.data.accounting import SourceCounts
from trainer.data.base import DataError, DataModule, Settings, named_source_problems
from trainer.data.cache import cached, code_version, fingerprint
from trainer.data.chat import JinjaTemplate, Record, as_conversation, prompt_text
from trainer.data.loader import PackedBatches
from trainer.data.mixture import Mixture, SourceSamples, SourceSpec
from trainer.data.packing import LONG_SAMPLES, Packer, fit_long_samples, rows_to_tensors
from trainer.data.sources import CONVERSATIONS, SOURCE_FIELDS, Source, as_int
from trainer.data.tokenizer import Tokenizer
from trainer.evaluators.exact_match import ExactMatch, GenerationSet

FIELDS = (*SOURCE_FIELDS, "weight", "max_tokens", "max_epochs", "metric", "string_rows")
METRICS = ("loss", "exact_match")
STRING_ROWS = ("text", "chat")  # standard rows as they are (TRL), or as chat turns


def parse_source(name: str, node: Mapping[str, Any]) -> tuple[Source, str, SourceSpec]:
    """The source, its metric and its budget.

    Raises:
        ValueError: an unknown field or an impossible value (naming ``data.sources.<name>``).
    """
    source = CONVERSATIONS.parse(name, node, FIELDS)
    metric = node.get("metric", "loss")
    if metric not in METRICS:
        raise ValueError(f"data.sources.{name}.metric={metric!r}: use one of {METRICS}")
    if node.get("string_rows", "text") not in STRING_ROWS:
        raise ValueError(
            f"data.sources.{name}.string_rows={node.get('string_rows')!r}: use text (string prompt/completion rows as "
            "they are, TRL's standard format) or chat (as a user and an assistant turn through the chat template)"
        )
    try:
        spec = SourceSpec(
            weight=float(node.get("weight", 1.0)),
            max_tokens=as_int(node.get("max_tokens")),
            max_epochs=None if node.get("max_epochs", 1.0) is None else float(node.get("max_epochs", 1.0)),
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"data.sources.{name}: {err}") from None
    return source, metric, spec


def _budget(spec: SourceSpec) -> tuple[str, float | int]:
    """The budget that ends a source: (field, value)."""
    return ("max_tokens", spec.max_tokens) if spec.max_tokens is not None else ("max_epochs", spec.max_epochs)


@dataclass
class PreparedSFT:
    """The prepared data: tokenizer, chat template (None: default), tokenized samples per source
    and the held-out prompts of the sources scored by exact match."""

    tokenizer: Tokenizer
    template: JinjaTemplate | None
    train: dict[str, SourceSamples]
    val: dict[str, SourceSamples]
    prompts: dict[str, GenerationSet]


class SFTDataModule(DataModule):
    """Chat SFT data with per-source supervised-token budgets (see module docstring).

    Args:
        sources: name -> source fields (see module docstring); the order numbers the sources.
        template: "auto" (the tokenizer's chat template if it has one, else the default),
            "default" or "tokenizer" (the chat template beside ``data.tokenizer``, where transformers
            reads it: trainer.data.chat_files).
        long_samples: policy for samples longer than ``seq_len``: split, truncate, drop, error.
        **settings: ``seq_len`` (tokens per packed row), ``tokenizer``, ``vocab_size``, ``seed``
            (splits, synthetic data, the mixture's permutations), ``cache_dir``, ``run``
            (`DataModule`).

    Raises:
        DataError: a problem of `node_problems`.
    """

    catalog = CONVERSATIONS  # the names of data.sources.<name>.source it reads as bundled or synthetic sets

    def __init__(
        self,
        *,
        sources: dict[str, dict[str, Any]],
        template: str = "auto",
        long_samples: str = "split",
        **settings: Unpack[Settings],
    ) -> None:
        super().__init__(**settings)
        problems = self.node_problems({"sources": sources, "template": template, "long_samples": long_samples})
        if problems:
            raise DataError("; ".join(problems))
        parsed = {name: parse_source(name, dict(node or {})) for name, node in sources.items()}
        self.sources = {name: p[0] for name, p in parsed.items()}
        self.chat_strings = {name: (node or {}).get("string_rows", "text") == "chat" for name, node in sources.items()}
        self.metrics = {name: p[1] for name, p in parsed.items()}
        self.specs = {name: p[2] for name, p in parsed.items()}
        self.names = list(sources)
        self.given = {name: set(node or {}) for name, node in sources.items()}  # the fields each source sets
        self.template_name, self.long_samples = template, long_samples
        self.counts: dict[str, SourceCounts] = {}
        self.val_counts: dict[str, SourceCounts] = {}

    @override
    @classmethod
    def node_problems(cls, node: Any) -> list[str]:
        """Problems of the sources, their budgets, the template and the long-sample policy."""
        problems = named_source_problems(node, parse_source, CONVERSATIONS.empty_problem())
        if hasattr(node, "get") and node.get("long_samples", "split") not in LONG_SAMPLES:
            problems.append(f"data.long_samples={node.get('long_samples')!r}: use one of {LONG_SAMPLES}")
        return problems

    @override
    @classmethod
    def evaluator_types(cls, node: Any) -> list[type[ExactMatch]]:
        """`ExactMatch` when a source of ``node`` has ``metric: exact_match``."""
        return [ExactMatch] if ExactMatch.decoded_sources(node) else []

    # ------------------------------------------------------------------------------ preparation
    @override
    def _prepare(self) -> PreparedSFT:
        """Tokenizer and tokenized train/val samples per source (cached).

        Raises:
            DataError: missing data packages, a budget the epochs cannot reach, or a long sample
                under ``long_samples=error``.
        """
        convs = {name: self._records(name) for name in self.names}
        train_texts = ["".join(t for t, _ in encode.segments(c, None)) for tr, _ in convs.values() for c in tr]
        tokenizer = self.load_tokenizer(train_texts, fingerprint("sft", *train_texts))
        template = self.chat_template(self.template_name, tokenizer)
        # The template's text and tokens are in the key: an edited chat_template.jinja must not reuse stale samples.
        source = "" if template is None else json.dumps([template.source, template.special], sort_keys=True)
        key = fingerprint(
            json.dumps(convs, sort_keys=True),
            tokenizer.fingerprint,
            self.template_name,
            str(template is None),
            source,
            code_version(),
        )

        def damage(encoded: dict[str, list]) -> str | None:  # a cache file overwritten by other samples
            samples = [ids for parts in encoded.values() for part in parts for ids, _ in part if ids]
            low, high = min(map(min, samples), default=0), max(map(max, samples), default=0)
            if 0 <= low and high < tokenizer.vocab_size:
                return None
            return f"a token id in [{low}, {high}] outside the vocabulary of {tokenizer.vocab_size}"

        encoded = cached(
            self.cache_dir / f"sft-{key}.pt",
            lambda: {n: [encode.conversations(tokenizer, part, template) for part in convs[n]] for n in self.names},
            check=damage,
        )
        train = {n: self._fit(n, encoded[n][0], self.counts) for n in self.names}
        val = {n: self._fit(n, encoded[n][1], self.val_counts) for n in self.names}
        problems = accounting.problems(self.counts, self.noun, self.val_counts)
        problems += Mixture(train, self.specs, seed=self.seed).check_reachable() if not problems else []
        if problems:
            raise DataError("; ".join(problems))
        prompts = {
            n: self._generation_set(convs[n][1], tokenizer, template)
            for n in self.names
            if self.metrics[n] == "exact_match"
        }
        return PreparedSFT(tokenizer=tokenizer, template=template, train=train, val=val, prompts=prompts)

    def _records(self, name: str) -> tuple[list[Record], list[Record]]:
        """``(train, val)`` records of one source; with ``string_rows: chat``, standard rows as chat turns."""
        train, val = CONVERSATIONS.records(self.sources[name], seed=self.seed)
        if self.chat_strings[name]:
            return [as_conversation(r) for r in train], [as_conversation(r) for r in val]
        return train, val

    def _fit(self, name: str, samples: list, into: dict[str, SourceCounts]) -> SourceSamples:
        """Fit one source's split to ``data.seq_len`` by ``long_samples``, its counts into ``into[name]``."""
        try:
            kept, counts = fit_long_samples(samples, seq_len=self.seq_len, policy=self.long_samples)
        except ValueError as err:
            raise DataError(f"data.sources.{name}: {err}") from None
        other = (
            "truncate (a long conversation keeps its start and loses its end)"
            if self.long_samples == "split"
            else "split (a long conversation continues in the next rows, its pieces as separate documents)"
        )
        counts.fix = accounting.seq_len_fix([len(ids) for ids, _ in samples], self.seq_len, self.noun) + (
            f", or data.long_samples={other}"
        )
        into[name] = counts
        return SourceSamples([ids for ids, _ in kept], [labels for _, labels in kept])

    @property
    @override
    def noun(self) -> str:
        return "conversations"

    @override
    def data_counts(self) -> dict[str, SourceCounts]:
        """What ``long_samples`` cut from each source's training conversations (trainer.data.accounting)."""
        self.prepare()
        return self.counts

    @override
    def held_out_counts(self) -> dict[str, SourceCounts]:
        """What ``long_samples`` cut from each source's held-out conversations (scored as cut)."""
        self.prepare()
        return self.val_counts

    def _generation_set(self, val: list[Record], tokenizer: Tokenizer, template: JinjaTemplate | None) -> GenerationSet:
        prompts, answers = [], []
        for messages in val:
            if isinstance(messages, dict):  # a standard row: its prompt as it is, no template
                if messages["prompt"]:
                    prompts.append(tokenizer.encode(messages["prompt"]))
                    answers.append(messages["completion"].strip())
                continue
            if messages[-1]["role"] != "assistant":
                continue
            text = (
                prompt_text(messages[:-1])
                if template is None
                else template.render(messages[:-1], add_generation_prompt=True)
            )
            prompts.append(tokenizer.encode(text))
            answers.append(messages[-1]["content"].strip())
        return GenerationSet(prompts, answers)

    # ------------------------------------------------------------------------------ loaders
    def _packer(self, samples: dict[str, SourceSamples], specs: dict[str, SourceSpec]) -> Packer:
        mixture = Mixture(samples, specs, seed=self.seed)
        return Packer(mixture, seq_len=self.seq_len, pad_id=self.tokenizer.pad_id, policy="whole")

    @override
    def train_batches(self, dp_rank: int, dp_size: int) -> PackedBatches:
        prepared = self.prepare()
        return PackedBatches(
            lambda: self._packer(prepared.train, self.specs),
            names=self.names,
            global_batch_size=self.global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            dropped={n: c.supervised_tokens_lost for n, c in self.counts.items() if c.supervised_tokens_lost},
            balancer=self.balancer,
        )

    @override
    def finite_steps(self) -> int:
        """Optimizer steps of one pass over the mixture (the run ends there)."""
        return self.steps_per_epoch()

    @override
    def end_reason(self, steps: int) -> str:
        """The budgets that end the mixture after ``steps`` optimizer steps and the settings that
        lengthen it: each drawn source's ``max_tokens`` if set (then ``max_epochs`` only bounds
        it, `Mixture.check_reachable`), else its ``max_epochs``."""
        train = self.prepare().train
        spent = [
            (n, _budget(self.specs[n])) for n in self.names if self.specs[n].weight > 0 and train[n].total_supervised()
        ]
        if len(spent) == 1:
            [(name, (field, value))] = spent
            return f"data.sources.{name} is spent after {field}={value} ({steps} steps); raise {self._key(name, field)}"
        budgets = ", ".join(f"{name} {field}={value}" for name, (field, value) in spent)
        fixes = " or ".join(self._key(name, field) for name, (field, value) in spent)
        return f"every source of data.sources is spent after {steps} steps ({budgets}); raise {fixes}"

    def _key(self, name: str, field: str) -> str:
        """The override key of a source's field, as typed: with ``+`` when the source does not set it
        (a source given as a mapping has only the fields it names)."""
        return f"{'' if field in self.given[name] else '+'}data.sources.{name}.{field}"

    @override
    def eval_rows(self) -> dict[str, Tensor]:
        """Every source's held-out samples, packed (``source_ids`` mark the source)."""
        val_specs = {n: SourceSpec(weight=1.0, max_tokens=None, max_epochs=1.0) for n in self.names}
        packer = self._packer(self.prepare().val, val_specs)
        rows = []
        while (row := packer.next_row()) is not None:
            rows.append(row)
        return rows_to_tensors(rows, num_rows=len(rows), seq_len=self.seq_len, pad_id=self.tokenizer.pad_id)

    @override
    def evaluators(self) -> list[ExactMatch]:
        """Greedy-decoding exact match of the sources with ``metric: exact_match`` ([] without any)."""
        prepared = self.prepare()
        if not prepared.prompts:
            return []
        return [ExactMatch(prepared.prompts, prepared.tokenizer, self.stop_ids(), self.stop_texts())]
