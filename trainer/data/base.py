"""`DataModule`: the one base of plait's data modules (text, chat SFT, preference pairs).

Every data module runs one pipeline, each step in one place:

    sources (trainer.data.corpus, trainer.data.sources)
      -> tokenizer (trainer.data.tokenizer: a file, or a BPE trained on the training texts)
      -> encode (trainer.data.encode: text / chat / pair samples)
      -> pack (trainer.data.packing: one packer, ``split`` or ``whole`` policy)
      -> one train loader (trainer.data.loader: global batches, state = the position trained)

Preparation runs once in the launching process (so data errors surface before any process group
starts) and is cached under ``cache_dir`` (trainer.data.cache); every rank then loads the same
cached data. A data module runs no model: what needs one (reference log-probs, greedy decoding)
belongs to the objective or an evaluator.

A subclass implements `_prepare` (the prepared data, with a ``tokenizer``), `train_batches`
(its `GlobalBatches` stream for one dp rank) and `eval_rows` (the held-out rows).
"""

from __future__ import annotations

import os
import sys
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypedDict

import lightning as L
import torch
from torch import Tensor
from typing_extensions import Required, override

from strategies.core.ranges import POSITIVE, Range
from strategies.core.resolved import ResolvedRun
from trainer import protocols
from trainer.data.accounting import SourceCounts
from trainer.data.answer_end import turn_end_ids, turn_end_text
from trainer.data.balance import Balancer, WorkModel
from trainer.data.cache import cache_dir_problem
from trainer.data.chat import ChatFormat, JinjaTemplate, load_chat_template
from trainer.data.chat_files import PLACES
from trainer.data.fingerprint import prepared_fingerprint
from trainer.data.loader import Batch, GlobalBatches, Loader, shard_rows
from trainer.data.tokenizer import Tokenizer, load_or_train
from trainer.protocols import Evaluator

MIN_VOCAB = 258  # the 256 byte tokens and the two special tokens of the BPE plait trains

TEMPLATES = ("auto", "default", "tokenizer")


class DataError(ValueError):
    """Data that cannot be trained on; the message names the data and the fix."""


class Settings(TypedDict, total=False):
    """The ``data.*`` keys every data module takes, with their defaults in `DataModule` (a
    subclass takes them as ``**settings: Unpack[Settings]`` and passes them on), and the resolved
    run the builder passes."""

    run: Required[ResolvedRun]
    seq_len: int
    tokenizer: str | None
    vocab_size: int
    seed: int
    cache_dir: str
    balance: Literal["none", "work"]


class DataModule(L.LightningDataModule, protocols.DataModule):
    """The shared part of every data module (see module docstring).

    Args:
        run: the resolved run (passed by the builder): its ``global_batch_size``, rows (or pairs)
            per optimizer step over all dp ranks. The dp rank and size come from the trainer when
            the loaders are made: the global batches never depend on them.
        seq_len: tokens per row.
        tokenizer: path of a ``tokenizer.json``; None trains a byte-level BPE on the training texts.
        vocab_size: vocabulary of the trained BPE.
        seed: seeds splits, synthetic data and the order of the rows.
        cache_dir: where tokenizers and prepared data are cached.
        balance: ``work`` orders each step's rows over dp ranks and micro-batches so that the
            estimated work per rank is balanced (`trainer.data.balance`; same rows per step, same
            loss and gradient); ``none`` keeps the sampler's or packer's order.
    """

    # Rows per forward when evaluating. The validation loss is a sum over micro-batches, so its
    # last bits depend on this; one value for every data module keeps val/loss comparable.
    eval_micro_batch_size = 8

    # Fields of the prepared data `data_fingerprint` leaves out: the tokenizer and its template
    # (compared by the tokenizer's own fingerprint), and what the run fills in later.
    UNHASHED: ClassVar[tuple[str, ...]] = ("tokenizer", "template")

    def __init__(
        self,
        *,
        run: ResolvedRun,
        seq_len: Annotated[int, POSITIVE] = 256,
        tokenizer: str | None = None,
        vocab_size: Annotated[int, Range(min=MIN_VOCAB)] = 4096,
        seed: int = 0,
        cache_dir: str = "~/.cache/plait",
        balance: Literal["none", "work"] = "none",
    ) -> None:
        super().__init__()
        self.seq_len, self.tokenizer_path, self.vocab_size, self.seed = seq_len, tokenizer, vocab_size, seed
        self.cache_dir = Path(os.path.expanduser(cache_dir))
        self.global_batch_size = run.global_batch_size
        self.balancer = Balancer(WorkModel.of(run.shape), run.micro_batch_size) if balance == "work" else None
        self._prepared: Any = None
        self._chat: ChatFormat | None = None  # set by chat_template while preparing
        self._answer_ends: tuple[tuple[int, ...], tuple[str, ...]] | None = None  # stop_ids, stop_texts

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """`trainer.protocols.Component.problems` of a ``data`` node, for `trainer.config.validate`
        (before any launch): the node's own (`node_problems`), a ``cache_dir`` that cannot hold the
        cache (`trainer.data.cache.cache_dir_problem`), ``balance=work`` without dp ranks; ``run``
        is None when the layout itself is invalid."""
        problems = cls.node_problems(node)
        if "cache_dir" in node and (problem := cache_dir_problem(str(node.cache_dir))):
            problems.append(problem)
        balance = node.get("balance", "none")
        if balance == "work" and run is not None and run.dims.dp == 1:
            problems.append(
                "data.balance=work has nothing to balance: one dp rank trains every row of the step; use "
                "data.balance=none, or more than one dp rank (strategy.dp_shard / dp_replicate, trainer.devices)"
            )
        return problems

    @classmethod
    def node_problems(cls, node: Any) -> list[str]:
        """Problems of a ``data`` node (a mapping): none to find before the data is read, here."""
        return []

    # ------------------------------------------------------------------------------ preparation
    def prepare(self) -> Any:
        """The prepared data (built once per process, cached on disk; see `_prepare`).

        Raises:
            DataError: data that cannot be trained on (the message names the fix).
        """
        if self._prepared is None:
            self._prepared = self._prepare()
        return self._prepared

    @abstractmethod
    def _prepare(self) -> Any:
        """Builds the prepared data: an object with a ``tokenizer`` and the encoded splits."""

    @property
    def tokenizer(self) -> Tokenizer:
        return self.prepare().tokenizer

    def data_fingerprint(self) -> str:
        """A hash of the prepared data (`trainer.data.fingerprint`; the tokenizer and the fields of
        ``UNHASHED`` left out): what a checkpoint's data position indexes, compared on resume."""
        return prepared_fingerprint(self.prepare(), skip=self.UNHASHED)

    def load_tokenizer(self, texts: Callable[[], Iterable[str]] | Sequence[str], fingerprint: str) -> Tokenizer:
        """``data.tokenizer``, else a BPE trained on ``texts`` (cached under ``fingerprint``)."""
        return load_or_train(
            path=self.tokenizer_path,
            texts=texts,
            vocab_size=self.vocab_size,
            cache_dir=self.cache_dir,
            corpus_fingerprint=fingerprint,
        )

    def chat_template(self, name: str, tokenizer: Tokenizer) -> JinjaTemplate | None:
        """The chat template ``data.template=name`` selects (None: the default template); the
        choice is kept for `chat_format`.

        Raises:
            DataError: ``tokenizer`` asked for, but the tokenizer has none.
            trainer.data.chat.ChatError: the tokenizer's template files are unusable.
        """
        if name == "default":
            self._chat = ChatFormat(None, "data.template=default")
            return None
        template = load_chat_template(self.tokenizer_path, tokenizer)
        where = (
            f"beside {self.tokenizer_path}"
            if self.tokenizer_path
            else "with the BPE plait trains (data.tokenizer=null)"
        )
        if template is None and name == "tokenizer":
            raise DataError(
                f"data.template=tokenizer but there is no chat template {where} (looked for {PLACES}); "
                "use data.template=auto or default, or give a data.tokenizer=<dir>/tokenizer.json that has one"
            )
        self._chat = ChatFormat(
            template, "" if template is not None else f"data.template={name}: no chat template {where}"
        )
        return template

    def chat_format(self) -> ChatFormat | None:
        """The chat template the prepared data renders with and where it came from (None: data
        without chat, such as pretraining text)."""
        self.prepare()
        return self._chat

    def stop_ids(self) -> tuple[int, ...]:
        """The tokens besides EOS that end a generated answer under the chat template the data
        renders with (`trainer.data.answer_end.turn_end_ids`: ChatML's ``<|im_end|>``, ...); none for
        plait's default template and for data without chat."""
        return self._answer_end()[0]

    def stop_texts(self) -> tuple[str, ...]:
        """The template's end-of-turn marker where no token of `stop_ids` spells it
        (`trainer.data.answer_end.turn_end_text`): a completion is cut at it."""
        return self._answer_end()[1]

    def _answer_end(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if self._answer_ends is None:
            chat = self.chat_format()
            template = chat.template if chat is not None else None
            self._answer_ends = (turn_end_ids(self.tokenizer, template), turn_end_text(self.tokenizer, template))
            for marker in self._answer_ends[1]:
                print(
                    f"plait: the chat template's end of turn {marker!r} is not one special token of the tokenizer: "
                    "generated answers are cut at its text, and decoding goes on to their token limit",
                    file=sys.stderr,
                )
            if template is not None and not template.turn_end().strip():
                print(
                    f"plait: {template.origin}: no end-of-turn marker found after an answer (the template writes "
                    "none, alters the answer's text, or refused a one-question conversation): generated answers "
                    "stop at EOS only",
                    file=sys.stderr,
                )
        return self._answer_ends

    def model_chat_template(self) -> JinjaTemplate | None:
        """The chat template that goes with the trained model (a run records it, an export
        writes it): the one the data renders with, or for data without chat the tokenizer's own;
        None: plait's default.

        Raises:
            trainer.data.chat.ChatError: the tokenizer's template files are unusable.
        """
        chat = self.chat_format()
        return chat.template if chat is not None else load_chat_template(self.tokenizer_path, self.tokenizer)

    # ------------------------------------------------------------------------------ loaders
    @abstractmethod
    def train_batches(self, dp_rank: int, dp_size: int) -> GlobalBatches:
        """The training batches of dp rank ``dp_rank`` of ``dp_size``."""

    @abstractmethod
    def eval_rows(self) -> dict[str, Tensor]:
        """The held-out rows evaluated, key -> ``[N, ...]`` tensor (all dp ranks together)."""

    def dp(self) -> tuple[int, int]:
        """``(rank, size)`` of this process on the data-parallel axis (one process without a trainer)."""
        if self.trainer is None:
            return 0, 1
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        return kwargs["rank"], kwargs["num_replicas"]

    @override
    def setup(self, stage: str) -> None:
        self.prepare()

    @override
    def train_dataloader(self) -> Loader:
        if self.trainer is None:
            return Loader(self.train_batches(0, 1), pin_memory=torch.cuda.is_available())
        strategy = self.trainer.strategy  # with replica groups: this group's share of each batch
        share = getattr(strategy, "train_sampler_kwargs", strategy.distributed_sampler_kwargs)
        return Loader(self.train_batches(share["rank"], share["num_replicas"]), pin_memory=torch.cuda.is_available())

    def eval_dataloader(self) -> list[Batch]:
        """This dp rank's share of `eval_rows` in micro-batches (`shard_rows`: every row once, the
        same number of forward passes on every rank)."""
        rank, size = self.dp()
        return shard_rows(self.eval_rows(), dp_rank=rank, dp_size=size, micro_batch_size=self.eval_micro_batch_size)

    def steps_per_epoch(self) -> int:
        """Optimizer steps of one epoch (of one pass, for data that ends)."""
        return len(Loader(self.train_batches(0, 1)))

    def finite_steps(self) -> int | None:
        """Optimizer steps until the data ends (`trainer.protocols.DataModule`); None: it repeats by epochs."""
        return None

    def end_reason(self, steps: int) -> str:
        """Why the data ends after ``steps`` optimizer steps, and what lengthens it (`trainer.run_length`)."""
        return f"the training data ends after {steps} steps"

    def evaluators(self) -> list[Evaluator]:
        """What scores the model beyond the loss at each evaluation (`trainer.protocols.Evaluator`); none here."""
        return []

    @property
    def noun(self) -> str:
        """What one training sample is (``samples``, ``pairs``, ...), for the data lines."""
        return "samples"

    def data_counts(self) -> dict[str, SourceCounts]:
        """What preparation cut from each source's training samples (trainer.data.accounting);
        {} where nothing is cut (packed text continues a document in the next row)."""
        return {}

    def held_out_counts(self) -> dict[str, SourceCounts]:
        """What preparation cut from each source's held-out samples, counted as `data_counts`; {} here."""
        return {}


def named_source_problems(node: Any, parse: Callable[[str, Mapping[str, Any]], Any], empty: str) -> list[str]:
    """Problems of a ``data`` node with named ``sources`` and a ``template``, for
    `trainer.config.validate` (before any launch).

    Args:
        node: the ``data`` config node.
        parse: parses one source (raises ValueError naming ``data.sources.<name>``).
        empty: the problem of an empty ``data.sources``.
    """
    sources = node.get("sources") if hasattr(node, "get") else None
    if not sources:
        return [empty]
    problems = []
    for name, sub in sources.items():
        try:
            parse(str(name), dict(sub or {}))
        except ValueError as err:
            problems.append(str(err))
    if node.get("template", "auto") not in TEMPLATES:
        problems.append(f"data.template={node.get('template')!r}: use one of {TEMPLATES}")
    return problems
