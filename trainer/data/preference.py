"""`PreferenceDataModule`: (prompt, chosen, rejected) pairs -> chat-formatted row pairs with
response-only labels, and the reference model's log-probs from a pre-pass.

Formatting reuses the SFT chat templates (trainer.data.chat): the prompt is the conversation up
to the final assistant turn (earlier assistant turns are context, never targets), each response
is the final assistant turn's supervised span (the default template appends EOS). Chosen and
rejected rows start with the **same prompt ids**; labels are pre-shifted and -100 everywhere
but on response tokens (case C24).

Truncation keeps as much of the responses as fits in ``seq_len``: when prompt + the longer
response is too long, the prompt keeps its last ``max(max_prompt_len, seq_len - response)``
tokens (never more than it has), then both responses are cut at the end to what is left. Pairs
whose responses lose tokens are counted and printed.

Reference log-probs (DPO, IPO): rather than a second, frozen copy of the model sharded like the
policy, the Task calls `prepass` once before the first optimizer step, when the (parallelized)
policy still *is* the reference: every dp rank scores its share of the train and validation pairs
with no gradient, and one all-reduce gives every rank the ``[pairs, 2]`` table, stored with the
rows (``ref_logps`` in each batch) and in checkpoints (`state_dict`). Training then holds one
model, FSDP and TP included, and the reference costs one forward per pair, once.

Sources (``sources: {name: {source, limit, val_size}}``): ``dpo_en`` and ``champ`` (real pairs
from pip packages), ``copy`` and ``addition`` (synthetic, verifiable), or a ``.jsonl`` path; see
trainer.data.preference_sources.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from trainer.data import preference_sources as sources_mod
from trainer.data.chat import JinjaTemplate, default_segments, load_chat_template
from trainer.data.module import DataError
from trainer.data.packing import IGNORE_INDEX
from trainer.data.sampler import GlobalBatchSampler, StatefulLoader
from trainer.data.tokenizer import Tokenizer, load_or_train

KEYS = ("input_ids", "labels", "position_ids", "document_ids")
SOURCE_FIELDS = {"source", "limit", "val_size"}


def encode_pair(
    tokenizer: Tokenizer, pair: sources_mod.Pair, template: JinjaTemplate | None = None
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of one pair in the chat format.

    Raises:
        trainer.data.chat.ChatError: a malformed conversation.
        DataError: the template renders the prompt differently for the two responses.
    """
    encoded = []
    for response in (pair["chosen"], pair["rejected"]):
        messages = [*pair["messages"], {"role": "assistant", "content": response}]
        segments = default_segments(messages) if template is None else template.segments(messages)
        last = max(i for i, (_, supervised) in enumerate(segments) if supervised)
        prompt = [tokenizer.encode(text) if text else [] for text, _ in segments[:last]]
        # The SFT format: the default template ends every assistant turn (context ones too) with EOS.
        eos = [tokenizer.eos_id] if template is None else []
        prompt_ids = [t for (_, sup), piece in zip(segments[:last], prompt) for t in piece + (eos if sup else [])]
        encoded.append((prompt_ids, tokenizer.encode(segments[last][0]) + eos))
    if encoded[0][0] != encoded[1][0]:
        raise DataError("the chat template renders the prompt differently for the chosen and rejected responses")
    return encoded[0][0], encoded[0][1], encoded[1][1]


def pair_rows(
    prompt: list[int], chosen: list[int], rejected: list[int], *, seq_len: int, max_prompt_len: int, pad_id: int
) -> tuple[dict[str, torch.Tensor], bool]:
    """The ``[2, seq_len]`` rows of one pair (chosen first) and whether a response was cut.

    ``labels[t] = input_ids[t + 1]`` where token t+1 is a response token, else -100.
    """
    longest = max(len(chosen), len(rejected))
    keep = min(len(prompt), max(max_prompt_len, seq_len - longest))
    prompt = prompt[len(prompt) - keep :]
    room = seq_len - len(prompt)
    cut = longest > room
    out = {k: torch.zeros(2, seq_len, dtype=torch.long) for k in KEYS}
    out["input_ids"].fill_(pad_id)
    out["labels"].fill_(IGNORE_INDEX)
    for i, response in enumerate((chosen[:room], rejected[:room])):
        ids = prompt + response
        out["input_ids"][i, : len(ids)] = torch.tensor(ids)
        out["labels"][i, len(prompt) - 1 : len(ids) - 1] = torch.tensor(response)
        out["position_ids"][i] = torch.arange(seq_len)
        out["document_ids"][i, len(ids) :] = 1  # the pad tail is a document of its own
    return out, cut


class PairDataset(Dataset):
    """Pairs as ``[2, T]`` rows; ``ref_logps`` (``[2]``) comes from the table the pre-pass fills."""

    def __init__(self, rows: dict[str, torch.Tensor], ref_logps: torch.Tensor) -> None:
        self.rows, self.ref_logps = rows, ref_logps

    def __len__(self) -> int:
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**{k: v[i] for k, v in self.rows.items()}, "ref_logps": self.ref_logps[i]}


@dataclass
class PreparedPairs:
    """Tokenizer, ``[N, 2, T]`` rows per key of each split, and the ``[N, 2]`` reference tables
    (NaN until the pre-pass fills them)."""

    tokenizer: Tokenizer
    train: dict[str, torch.Tensor]
    val: dict[str, torch.Tensor]
    train_ref: torch.Tensor
    val_ref: torch.Tensor


def _fingerprint(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8") + b"\x00\x01")
    return digest.hexdigest()[:16]


class PreferenceDataModule(L.LightningDataModule):
    """Preference pairs for DPO / IPO / SimPO / ORPO (see module docstring).

    Args:
        sources: name -> ``{source, limit, val_size}``; ``source`` is ``dpo_en``, ``champ``,
            ``copy``, ``addition`` or a ``.jsonl`` path; ``limit`` caps the training pairs (a
            synthetic set generates that many, default 1000); ``val_size`` pairs are held out.
        seq_len: tokens per row (prompt + response).
        max_prompt_len: tokens the prompt keeps at least when a pair is too long.
        template: "auto", "default" or "tokenizer" (as for SFT).
        tokenizer: a ``tokenizer.json`` (use the base model's run's); None trains a BPE.
        vocab_size: of the trained BPE.
        seed: seeds splits, synthetic data and the shuffle.
        cache_dir: tokenizers are cached here.
        global_batch_size: pairs per optimizer step (set by the trainer).
    """

    def __init__(
        self,
        *,
        sources: dict[str, dict[str, Any]],
        seq_len: int = 256,
        max_prompt_len: int = 128,
        template: str = "auto",
        tokenizer: str | None = None,
        vocab_size: int = 4096,
        seed: int = 0,
        cache_dir: str = "~/.cache/plait",
        global_batch_size: int = 32,
    ) -> None:
        super().__init__()
        problems = self.config_problems({"sources": sources, "template": template, "seq_len": seq_len, "max_prompt_len": max_prompt_len})
        if problems:
            raise DataError("; ".join(problems))
        self.sources = {name: dict(node or {}) for name, node in sources.items()}
        self.seq_len, self.max_prompt_len, self.template_name = seq_len, max_prompt_len, template
        self.tokenizer_path, self.vocab_size, self.seed = tokenizer, vocab_size, seed
        self.cache_dir = Path(os.path.expanduser(cache_dir))
        self.global_batch_size = global_batch_size
        self._prepared: PreparedPairs | None = None
        self.reference_ready = False

    @classmethod
    def config_problems(cls, node: Any) -> list[str]:
        """Problems of a ``data`` config node, for `trainer.config.validate` (before any launch)."""
        problems = []
        sources = node.get("sources")
        if not sources:
            return ["data.sources is empty; name at least one source, e.g. data.sources.pairs.source=dpo_en"]
        known = sorted(sources_mod.BUNDLED) + sorted(sources_mod.SYNTHETIC)
        for name, sub in sources.items():
            sub = dict(sub or {})
            if set(sub) - SOURCE_FIELDS:
                problems.append(f"data.sources.{name}: unknown fields {sorted(set(sub) - SOURCE_FIELDS)}; valid: {sorted(SOURCE_FIELDS)}")
            source = sub.get("source", name)
            if not isinstance(source, str) or not (source in known or source.endswith(".jsonl")):
                problems.append(f"data.sources.{name}.source={source!r}: use one of {known} or a path to a .jsonl file")
        if node.get("template", "auto") not in ("auto", "default", "tokenizer"):
            problems.append(f"data.template={node.get('template')!r}: use auto, default or tokenizer")
        if not 0 < node.get("max_prompt_len", 1) < node.get("seq_len", 2):
            problems.append(
                f"data.max_prompt_len={node.get('max_prompt_len')} must be positive and below data.seq_len={node.get('seq_len')} "
                "(the rest is room for the responses)"
            )
        return problems

    # ------------------------------------------------------------------------------ preparation
    def _pairs(self, name: str) -> tuple[list, list]:
        node = self.sources[name]
        source, limit, val_size = node.get("source", name), node.get("limit"), int(node.get("val_size", 16))
        if source in sources_mod.SYNTHETIC:
            made = sources_mod.synthetic(source, seed=self.seed, sizes={"train": int(limit or 1000), "val": val_size})
            return made["train"], made["val"]
        try:
            pairs = sources_mod.BUNDLED[source]() if source in sources_mod.BUNDLED else sources_mod.load_jsonl(source)
        except (FileNotFoundError, ValueError) as err:
            raise DataError(f"data.sources.{name}: {err}") from None
        score = [hashlib.sha256(f"{self.seed}\0{name}\0{i}".encode()).digest()[:8] for i in range(len(pairs))]
        held = set(sorted(range(len(pairs)), key=score.__getitem__)[: min(val_size, len(pairs) - 1)])
        train = [p for i, p in enumerate(pairs) if i not in held]
        return (train[: int(limit)] if limit else train), [p for i, p in enumerate(pairs) if i in held]

    def prepare(self) -> PreparedPairs:
        """Tokenizer and the ``train``/``val`` row tensors (``[N, 2, T]`` each key).

        Raises:
            DataError: missing data packages, or fewer training pairs than one global batch.
        """
        if self._prepared is not None:
            return self._prepared
        split = {name: self._pairs(name) for name in self.sources}
        texts = [m["content"] for tr, _ in split.values() for p in tr for m in p["messages"]]
        texts += [p[k] for tr, _ in split.values() for p in tr for k in ("chosen", "rejected")]
        tokenizer = load_or_train(
            path=self.tokenizer_path, texts=texts, vocab_size=self.vocab_size, cache_dir=self.cache_dir,
            corpus_fingerprint=_fingerprint("preference", json.dumps(split, sort_keys=True)),
        )  # fmt: skip
        template = None if self.template_name == "default" else load_chat_template(self.tokenizer_path, tokenizer)
        if template is None and self.template_name == "tokenizer":
            raise DataError(f"data.template=tokenizer but data.tokenizer={self.tokenizer_path} has no chat_template; use auto or default")
        prepared: dict[str, Any] = {"tokenizer": tokenizer}
        cut_pairs = 0
        for part, index in (("train", 0), ("val", 1)):
            rows = []
            for pairs in split.values():
                for pair in pairs[index]:
                    r, cut = pair_rows(
                        *encode_pair(tokenizer, pair, template), seq_len=self.seq_len,
                        max_prompt_len=self.max_prompt_len, pad_id=tokenizer.pad_id,
                    )  # fmt: skip
                    rows.append(r)
                    cut_pairs += int(cut and part == "train")
            prepared[part] = {k: torch.stack([r[k] for r in rows]) if rows else torch.zeros(0, 2, self.seq_len, dtype=torch.long) for k in KEYS}
            prepared[f"{part}_ref"] = torch.full((len(rows), 2), float("nan"))
        if len(prepared["train"]["input_ids"]) < self.global_batch_size:
            raise DataError(
                f"data.sources give {len(prepared['train']['input_ids'])} training pairs, fewer than one global batch of "
                f"train.global_batch_size={self.global_batch_size}; add pairs or lower train.global_batch_size"
            )
        if cut_pairs:
            print(f"plait: {cut_pairs} training pairs have responses cut at data.seq_len={self.seq_len}")
        self._prepared = PreparedPairs(**prepared)
        return self._prepared

    @property
    def tokenizer(self) -> Tokenizer:
        return self.prepare().tokenizer

    # ------------------------------------------------------------------------------ reference
    @torch.no_grad()
    def prepass(self, task: Any) -> None:
        """Scores every train and validation pair with the initial policy (the reference model).

        Called by the Task before the first optimizer step, on every rank; no-op for reference-free
        objectives and once the table is filled (or restored from a checkpoint).
        """
        if not getattr(task.objective, "needs_reference", False) or self.reference_ready:
            return
        strategy, prepared = task.trainer.strategy, self.prepare()
        dp = strategy.distributed_sampler_kwargs
        was_training = task.model.training
        task.model.eval()
        for part in ("train", "val"):
            rows = getattr(prepared, part)
            num = rows["input_ids"].shape[0]
            per_rank = -(-num // dp["num_replicas"])
            mine = range(dp["rank"] * per_rank, min(num, (dp["rank"] + 1) * per_rank))
            table = torch.zeros(num, 2, device=task.device)
            step = max(1, task.micro_batch_size)
            # Equal forwards on every rank (FSDP gathers parameters collectively): a short rank repeats a row.
            for start in range(0, per_rank, step):
                idx = [mine[min(j, len(mine) - 1)] if len(mine) else 0 for j in range(start, min(per_rank, start + step))]
                batch = {k: v[idx].to(task.device) for k, v in rows.items()}
                with task.trainer.precision_plugin.forward_context(), strategy.loss_context():
                    logps, _ = task.objective.sequence_logps_of(task.model, batch)
                valid = [j for j, i in enumerate(idx) if start + j < len(mine)]
                table[[idx[j] for j in valid]] = logps[valid].float()
            strategy.all_reduce_sum(table, "dp")
            getattr(prepared, f"{part}_ref").copy_(table.cpu())
        task.model.train(was_training)
        self.reference_ready = True

    @override
    def state_dict(self) -> dict[str, Any]:
        prepared = self.prepare()
        return {"train_ref": prepared.train_ref.clone(), "val_ref": prepared.val_ref.clone(), "ready": self.reference_ready}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        prepared = self.prepare()
        prepared.train_ref.copy_(state["train_ref"])
        prepared.val_ref.copy_(state["val_ref"])
        self.reference_ready = bool(state["ready"])

    # ------------------------------------------------------------------------------ loaders
    @override
    def setup(self, stage: str) -> None:
        self.prepare()

    def steps_per_epoch(self) -> int:
        return len(self.prepare().train["input_ids"]) // self.global_batch_size

    @override
    def train_dataloader(self) -> StatefulLoader:
        prepared = self.prepare()
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.trainer else {"num_replicas": 1, "rank": 0}
        sampler = GlobalBatchSampler(
            len(prepared.train["input_ids"]), global_batch_size=self.global_batch_size,
            dp_rank=dp["rank"], dp_size=dp["num_replicas"], shuffle=True, seed=self.seed,
        )  # fmt: skip
        return StatefulLoader(PairDataset(prepared.train, prepared.train_ref), sampler)

    def eval_dataloader(self) -> DataLoader:
        """This dp rank's share of the held-out pairs (trimmed to a multiple of dp)."""
        prepared = self.prepare()
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.trainer else {"num_replicas": 1, "rank": 0}
        per_rank = len(prepared.val["input_ids"]) // dp["num_replicas"]
        indices = list(range(dp["rank"] * per_rank, (dp["rank"] + 1) * per_rank))
        dataset = torch.utils.data.Subset(PairDataset(prepared.val, prepared.val_ref), indices)
        return DataLoader(dataset, batch_size=max(1, min(per_rank, 8)), shuffle=False)
