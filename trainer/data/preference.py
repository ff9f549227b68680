"""`PreferenceDataModule`: (prompt, chosen, rejected) pairs -> chat-formatted row pairs with
response-only labels, and a column for the reference model's log-probs.

Formatting reuses the SFT chat templates (trainer.data.encode.pair): the prompt is the
conversation up to the final assistant turn, each response is the final assistant turn's
supervised span (the default template appends EOS). Chosen and rejected rows start with the
**same prompt ids**; labels are pre-shifted and -100 everywhere but on response tokens (case
C24). Truncation keeps as much of the responses as fits in ``seq_len``
(trainer.data.encode.pair_rows); pairs whose prompt or responses lose tokens are counted per source
(trainer.data.accounting: printed at launch, a warning above 5%, refused when nothing is left).

Reference log-probs (DPO, IPO): rather than a second, frozen copy of the model sharded like the
policy, the objective scores every pair once before the first optimizer step, when the
(parallelized) policy still *is* the reference, and hands the ``[pairs, 2]`` tables to
`set_reference`. They travel with the rows (``ref_logps`` in each batch) and in checkpoints
(`state_dict`). Training then holds one model, FSDP and TP included, and the reference costs one
forward per pair, once.

Sources (``sources: {name: {source, limit, val_size, columns}}``): ``dpo_en`` and ``champ`` (real
pairs from pip packages), ``copy`` and ``addition`` (synthetic, verifiable), or a user's table in
TRL's formats (trainer.data.formats); see trainer.data.preference_sources.

Unpaired rows (``unpaired: true``, KTO: Ethayarajh et al. 2024): each row is one prompt, one
completion and its label (``desirable`` [N], 1.0 or 0.0); a pair source gives two rows (chosen:
desirable, rejected: undesirable; TRL's unpairing). Row index 0 of dim 1 holds the completion,
index 1 the prompt with a **mismatched** completion (another prompt's, of the same split: TRL's KL
rows, `_kl_rows`), whose log-ratios estimate the policy's KL to the reference (trainer.objectives.kto).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Unpack, override

from trainer.data import accounting, encode
from trainer.data.accounting import SourceCounts
from trainer.data.base import DataError, DataModule, Settings, named_source_problems
from trainer.data.cache import fingerprint
from trainer.data.loader import RowBatches
from trainer.data.sampler import GlobalBatchSampler
from trainer.data.sources import PAIRS, Source
from trainer.data.tokenizer import Tokenizer
from trainer.protocols import RowKind

SPLITS = ("train", "val")


@dataclass
class PreparedPairs:
    """Tokenizer, ``[N, 2, T]`` rows per key of each split, and the ``[N, 2]`` reference tables
    (NaN until `PreferenceDataModule.set_reference` fills them)."""

    tokenizer: Tokenizer
    train: dict[str, Tensor]
    val: dict[str, Tensor]
    train_ref: Tensor
    val_ref: Tensor


class PreferenceDataModule(DataModule):
    """Preference pairs for DPO / IPO / SimPO / ORPO (see module docstring).

    Args:
        sources: name -> ``{source, limit, val_size}``; ``source`` is ``dpo_en``, ``champ``,
            ``copy``, ``addition`` or a ``.jsonl`` path; ``limit`` caps the training pairs (a
            synthetic set generates that many, default 1000); ``val_size`` pairs are held out.
        max_prompt_len: tokens the prompt keeps at most when a pair is too long.
        unpaired: rows of one labelled completion each, with a KL row (KTO; module docstring).
        template: "auto", "default" or "tokenizer" (as for SFT).
        **settings: ``seq_len`` (tokens per row: prompt + response), ``tokenizer`` (use the base
            model's run's), ``vocab_size``, ``seed`` (splits, synthetic data, the shuffle),
            ``cache_dir``, ``run`` (its global batch: pairs per step) (`DataModule`).

    Raises:
        DataError: a problem of `node_problems`.
    """

    catalog = PAIRS  # the names of data.sources.<name>.source it reads as bundled or synthetic sets

    # The reference log-probs are computed from the model at the start of training (NaN before).
    UNHASHED = (*DataModule.UNHASHED, "train_ref", "val_ref")

    def __init__(
        self,
        *,
        sources: dict[str, dict[str, Any]],
        max_prompt_len: int = 128,
        unpaired: bool = False,
        template: str = "auto",
        **settings: Unpack[Settings],
    ) -> None:
        super().__init__(**settings)
        node = {"sources": sources, "template": template, "seq_len": self.seq_len, "max_prompt_len": max_prompt_len}
        if problems := self.node_problems(node):
            raise DataError("; ".join(problems))
        self.sources: dict[str, Source] = {name: PAIRS.parse(name, dict(n or {})) for name, n in sources.items()}
        self.max_prompt_len, self.template_name, self.unpaired = max_prompt_len, template, unpaired
        self.row_kind: RowKind = "unpaired" if unpaired else "pairs"
        self.reference_ready = False
        self.counts: dict[str, SourceCounts] = {}
        self.val_counts: dict[str, SourceCounts] = {}

    @override
    @classmethod
    def row_kind_of(cls, node: Any) -> RowKind:
        """Preference pairs, or unpaired rows with ``unpaired: true`` (KTO)."""
        return "unpaired" if node.get("unpaired", False) else "pairs"

    @override
    @classmethod
    def node_problems(cls, node: Any) -> list[str]:
        """Problems of the sources, the template and the prompt's share of the row."""
        problems = named_source_problems(node, PAIRS.parse, PAIRS.empty_problem())
        if hasattr(node, "get") and not 0 < node.get("max_prompt_len", 1) < node.get("seq_len", 2):
            problems.append(
                f"data.max_prompt_len={node.get('max_prompt_len')} must be positive and below data.seq_len={node.get('seq_len')} "
                "(the rest is room for the responses)"
            )
        return problems

    # ------------------------------------------------------------------------------ preparation
    @override
    def _prepare(self) -> PreparedPairs:
        """Tokenizer and the ``train``/``val`` row tensors (``[N, 2, T]`` each key).

        Raises:
            DataError: missing data packages, or fewer training pairs than one global batch.
        """
        split = {name: self._records(name, source) for name, source in self.sources.items()}
        texts = [m["content"] for tr, _ in split.values() for p in tr for m in p["messages"]]
        texts += [p[k] for tr, _ in split.values() for p in tr for k in ("chosen", "rejected")]
        tokenizer = self.load_tokenizer(texts, fingerprint("preference", json.dumps(split, sort_keys=True)))
        template = self.chat_template(self.template_name, tokenizer)
        prepared: dict[str, Any] = {"tokenizer": tokenizer}
        self.counts, self.val_counts = (
            {name: SourceCounts() for name in split},
            {name: SourceCounts() for name in split},
        )
        counts = {"train": self.counts, "val": self.val_counts}
        lengths: dict[str, dict[str, list[int]]] = {part: {name: [] for name in split} for part in SPLITS}
        for index, part in enumerate(SPLITS):
            rows = []
            for name, pairs in split.items():
                same = {True: 0, False: 0}  # pairs whose two rows are equal: cut, not cut
                for pair in pairs[index]:
                    prompt, chosen, rejected = encode.pair(tokenizer, pair, template)
                    r, cut = encode.pair_rows(
                        prompt,
                        chosen,
                        rejected,
                        seq_len=self.seq_len,
                        max_prompt_len=self.max_prompt_len,
                        pad_id=tokenizer.pad_id,
                        fit_first=self.unpaired,
                    )
                    rows.append(r)
                    lengths[part][name].append(
                        len(prompt) + (len(chosen) if self.unpaired else max(len(chosen), len(rejected)))
                    )
                    # Unpaired rows supervise their completion only: the other row is the KL estimate's.
                    lost = cut.chosen + (0 if self.unpaired else cut.rejected)
                    supervised = len(chosen) + (0 if self.unpaired else len(rejected))
                    counts[part][name].add(
                        supervised_kept=supervised - lost, supervised_lost=lost, prompt_lost=cut.prompt
                    )
                    if not self.unpaired and torch.equal(r["input_ids"][0], r["input_ids"][1]):
                        same[any(cut)] += 1
                why = {  # cut: (how they became equal, the fix)
                    True: ("once cut (chosen and rejected differ only past data.seq_len)", "raise data.seq_len"),
                    False: (
                        "once rendered and tokenized (the chat template makes them equal, e.g. trimming whitespace)",
                        "fix or drop those rows",
                    ),
                }
                for was_cut, count in same.items():
                    if count:
                        how, fix = why[was_cut]
                        print(
                            f"plait: warning: data.sources.{name}: {count} of {len(pairs[index])} {part} pairs are the "
                            f"same row twice {how}: they carry no preference (loss ln 2, no gradient, a tie in the "
                            f"accuracy); {fix}",
                            file=sys.stderr,
                        )
            prepared[part] = encode.stack_rows(rows, self.seq_len)
            if self.unpaired:
                labels = [p["desirable"] for pairs in split.values() for p in pairs[index]]
                prepared[part]["desirable"] = torch.tensor(labels, dtype=torch.float32).reshape(len(labels))
            prepared[f"{part}_ref"] = torch.full((len(rows), 2), float("nan"))
        for part in SPLITS:
            for name, c in counts[part].items():
                c.fix = accounting.seq_len_fix(lengths[part][name], self.seq_len, self.noun) + (
                    f", or change data.max_prompt_len (now {self.max_prompt_len}: the tokens a prompt keeps when its "
                    f"{'row' if self.unpaired else 'pair'} does not fit)"
                    if c.prompts_cut
                    else ""
                )
        if problems := accounting.problems(self.counts, self.noun, self.val_counts):
            raise DataError("; ".join(problems))
        if len(prepared["train"]["input_ids"]) < self.global_batch_size:
            raise DataError(
                f"data.sources give {len(prepared['train']['input_ids'])} training pairs, fewer than one global batch of "
                f"train.global_batch_size={self.global_batch_size}; add pairs or lower train.global_batch_size"
            )
        return PreparedPairs(**prepared)

    def _records(self, name: str, source: Source) -> tuple[list, list]:
        """``(train, val)`` pairs of one source; unpaired: KTO rows laid out as pairs (module
        docstring) with their ``desirable`` label.

        Raises:
            DataError: unpaired rows without ``data.unpaired`` (they have no rejected response).
        """
        records = PAIRS.records(source, seed=self.seed)
        if not self.unpaired:
            if any("label" in r for part in records for r in part):
                raise DataError(
                    f"data.sources.{name}: rows of prompt, completion and label are unpaired (KTO); train them with plait kto"
                )
            return records
        return tuple(_kl_rows(_unpair(part), name=name, split=split) for part, split in zip(records, SPLITS))

    @property
    @override
    def noun(self) -> str:
        return "labelled rows" if self.unpaired else "pairs"

    @override
    def data_counts(self) -> dict[str, SourceCounts]:
        """What preparation cut from each source's training pairs (trainer.data.accounting)."""
        self.prepare()
        return self.counts

    @override
    def held_out_counts(self) -> dict[str, SourceCounts]:
        """What preparation cut from each source's held-out pairs (scored as cut)."""
        self.prepare()
        return self.val_counts

    # ------------------------------------------------------------------------------ reference
    def pairs(self, split: str) -> dict[str, Tensor]:
        """The ``[N, 2, T]`` rows of ``split`` (``train`` or ``val``), for scoring by the objective."""
        return getattr(self.prepare(), split)

    def row_sources(self, split: str) -> list[str]:
        """The source of each row of `pairs` (``split``): `_prepare` lays the rows out source by
        source, in the order of ``data.sources``, and counts each source's (``SourceCounts.samples``)."""
        self.prepare()
        counts = self.counts if split == "train" else self.val_counts
        return [name for name, c in counts.items() for _ in range(c.samples)]

    def set_reference(self, split: str, logps: Tensor) -> None:
        """Stores the reference log-probs ``[N, 2]`` (chosen, rejected) of ``split``'s pairs; once
        both splits have theirs, `reference_ready` is True."""
        getattr(self.prepare(), f"{split}_ref").copy_(logps)
        self._filled = getattr(self, "_filled", set()) | {split}
        self.reference_ready = self._filled >= set(SPLITS)

    @override
    def state_dict(self) -> dict[str, Any]:
        prepared = self.prepare()
        return {
            "train_ref": prepared.train_ref.clone(),
            "val_ref": prepared.val_ref.clone(),
            "ready": self.reference_ready,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        prepared = self.prepare()
        prepared.train_ref.copy_(state["train_ref"])
        prepared.val_ref.copy_(state["val_ref"])
        self.reference_ready = bool(state["ready"])

    # ------------------------------------------------------------------------------ loaders
    @override
    def train_batches(self, dp_rank: int, dp_size: int) -> RowBatches:
        prepared = self.prepare()
        sampler = GlobalBatchSampler(
            len(prepared.train["input_ids"]),
            global_batch_size=self.global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            shuffle=True,
            seed=self.seed,
        )
        return RowBatches({**prepared.train, "ref_logps": prepared.train_ref}, sampler, self.balancer)

    @override
    def eval_rows(self) -> dict[str, Tensor]:
        prepared = self.prepare()
        return {**prepared.val, "ref_logps": prepared.val_ref}


def _unpair(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Unpaired rows: a pair gives its chosen (desirable) and its rejected (undesirable) row."""
    out = []
    for r in records:
        if "label" in r:
            out.append(r)
        else:
            out += [
                {"messages": r["messages"], "completion": r[k], "label": k == "chosen"} for k in ("chosen", "rejected")
            ]
    return out


def _kl_rows(rows: list[dict[str, Any]], *, name: str, split: str) -> list[dict[str, Any]]:
    """Each row as a pair: its completion, then a **mismatched** completion for the KL estimate.

    TRL's rule (KTOTrainer's KL dataset): the mismatched completions are the matched ones, paired
    with other prompts. Rows are grouped by prompt (groups in order of first appearance) and each
    takes the completion ``m`` places further round that order, ``m`` the largest group: no row
    takes an answer to its own prompt (a pair's chosen and rejected rows share one), and every
    completion is used once.

    Raises:
        DataError: more than half of the rows share one prompt (no such permutation exists).
    """
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(json.dumps(r["messages"], sort_keys=True), []).append(i)
    order = [i for members in groups.values() for i in members]
    shift = max((len(members) for members in groups.values()), default=0)
    if 2 * shift > len(rows):
        raise DataError(
            f"data.sources.{name}: {shift} of its {len(rows)} {split} rows share one prompt; KTO's KL estimate pairs every "
            "prompt with another prompt's completion, so no prompt may hold more than half of the rows: add rows with "
            f"other prompts{' or raise data.sources.' + name + '.val_size' if split == 'val' else ''}"
        )
    donor = {order[p]: order[(p + shift) % len(order)] for p in range(len(order))}
    return [
        {
            "messages": r["messages"],
            "chosen": r["completion"],
            "rejected": rows[donor[i]]["completion"],
            "desirable": float(r["label"]),
        }
        for i, r in enumerate(rows)
    ]
