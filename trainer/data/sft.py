"""`SFTDataModule`: named chat sources -> tokenizer -> budgeted mixture -> packed global batches.

Each entry of ``sources`` is one named source with its budget (trainer.data.mixture)::

    sources:
      math: {source: champ, weight: 1.0, max_tokens: 200000, max_epochs: null, limit: null,
             val_size: 16, metric: loss}

``source`` is a bundled real set (trainer.data.instructions: alpaca, glaive, humaneval, champ,
ifbench), a synthetic task (trainer.data.synthetic: reversal, sorting, addition) or a ``.jsonl``
file. ``limit`` caps the training conversations (synthetic: how many are generated, default 1000);
``val_size`` conversations are held out per source; ``metric`` is the source's held-out score for
the mSFT controller: ``loss`` (validation loss, lower is better) or ``exact_match`` (greedy
decoding of the held-out prompts, higher is better; single-turn sources).

Samples longer than ``seq_len`` follow ``long_samples``: ``split`` (continue in the next rows,
nothing lost; case C29), ``truncate`` (keep the first ``seq_len`` tokens), ``drop`` (leave the
sample out) or ``error``. Whatever is cut is counted per source, printed, and logged as
``train/dropped_tokens/<source>``; no supervised token disappears uncounted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from trainer.data import instructions, synthetic
from trainer.data.chat import JinjaTemplate, Message, default_segments, encode_conversations, load_chat_template, prompt_text
from trainer.data.mixture import Mixture, SourceSamples, SourceSpec
from trainer.data.mixture_loader import MixtureLoader, MixturePacker, rows_to_tensors
from trainer.data.module import DataError
from trainer.data.packing import IGNORE_INDEX
from trainer.data.tokenizer import Tokenizer, load_or_train

SOURCE_FIELDS = {"source", "weight", "max_tokens", "max_epochs", "limit", "val_size", "metric"}
LONG_SAMPLES = ("split", "truncate", "drop", "error")
METRICS = ("loss", "exact_match")
_SYNTHETIC_DEFAULT_SIZE = 1000


def _as_int(value: Any) -> int | None:
    """2e5 (Hydra parses it as a float) -> 200000; None stays None."""
    if value is None:
        return None
    if float(value) != int(value):
        raise ValueError(f"{value} is not a whole number")
    return int(value)


def parse_source(name: str, node: dict[str, Any]) -> tuple[dict[str, Any], SourceSpec]:
    """The source's fields with defaults, and its budget.

    Raises:
        ValueError: an unknown field or an impossible value (naming ``data.sources.<name>``).
    """
    unknown = set(node) - SOURCE_FIELDS
    if unknown:
        raise ValueError(f"data.sources.{name}: unknown fields {sorted(unknown)}; valid: {sorted(SOURCE_FIELDS)}")
    source = node.get("source", name)
    if not isinstance(source, str) or not (source in instructions.BUNDLED or source in synthetic.TASKS or source.endswith(".jsonl")):
        valid = sorted(instructions.BUNDLED) + sorted(synthetic.TASKS)
        raise ValueError(f"data.sources.{name}.source={source!r}: use one of {valid} or a path to a .jsonl file")
    fields = {
        "source": source,
        "limit": _as_int(node.get("limit")),
        "val_size": _as_int(node.get("val_size", 16)),
        "metric": node.get("metric", "loss"),
    }
    if fields["metric"] not in METRICS:
        raise ValueError(f"data.sources.{name}.metric={fields['metric']!r}: use one of {METRICS}")
    try:
        spec = SourceSpec(
            weight=float(node.get("weight", 1.0)),
            max_tokens=_as_int(node.get("max_tokens")),
            max_epochs=None if node.get("max_epochs", 1.0) is None else float(node.get("max_epochs", 1.0)),
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"data.sources.{name}: {err}") from None
    return fields, spec


@dataclass
class PreparedSFT:
    """The prepared data: tokenizer, chat template (None: default), tokenized samples per source
    and the exact-match prompts of the sources scored that way."""

    tokenizer: Tokenizer
    template: JinjaTemplate | None
    train: dict[str, SourceSamples]
    val: dict[str, SourceSamples]
    prompts: dict[str, dict[str, list]]


def _fingerprint(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8"))
        digest.update(b"\x00\x01")
    return digest.hexdigest()[:16]


def _hash_split(conversations: list[list[Message]], val_size: int, seed: int, name: str) -> tuple[list, list]:
    """The ``val_size`` conversations with the lowest hash of (seed, name, index) are held out."""
    scores = [hashlib.sha256(f"{seed}\0{name}\0{i}".encode()).digest()[:8] for i in range(len(conversations))]
    val_idx = set(sorted(range(len(conversations)), key=scores.__getitem__)[: min(val_size, len(conversations) - 1)])
    train = [c for i, c in enumerate(conversations) if i not in val_idx]
    return train, [c for i, c in enumerate(conversations) if i in val_idx]


class SFTDataModule(L.LightningDataModule):
    """Chat SFT data with per-source supervised-token budgets (see module docstring).

    Args:
        sources: name -> source fields (see module docstring); the order numbers the sources.
        seq_len: tokens per packed row.
        template: "auto" (the tokenizer's chat template if it has one, else the default),
            "default" or "tokenizer".
        tokenizer: a ``tokenizer.json`` (its ``tokenizer_config.json`` may hold a chat template);
            None trains a byte-level BPE on the training conversations.
        vocab_size: of the trained BPE.
        long_samples: policy for samples longer than ``seq_len``: split, truncate, drop, error.
        seed: seeds splits, synthetic data and the mixture's permutations.
        cache_dir: tokenizers and tokenized samples are cached here.
        global_batch_size: rows per optimizer step (set by the trainer).
    """

    def __init__(
        self,
        *,
        sources: dict[str, dict[str, Any]],
        seq_len: int = 256,
        template: str = "auto",
        tokenizer: str | None = None,
        vocab_size: int = 4096,
        long_samples: str = "split",
        seed: int = 0,
        cache_dir: str = "~/.cache/plait",
        global_batch_size: int = 32,
    ) -> None:
        super().__init__()
        problems = self.config_problems({"sources": sources, "template": template, "long_samples": long_samples})
        if problems:
            raise DataError("; ".join(problems))
        parsed = {name: parse_source(name, dict(node or {})) for name, node in sources.items()}
        self.fields = {name: f for name, (f, _) in parsed.items()}
        self.specs = {name: s for name, (_, s) in parsed.items()}
        self.names = list(sources)
        self.seq_len, self.template_name, self.tokenizer_path = seq_len, template, tokenizer
        self.vocab_size, self.long_samples, self.seed = vocab_size, long_samples, seed
        self.cache_dir = Path(os.path.expanduser(cache_dir))
        self.global_batch_size = global_batch_size
        self._prepared: PreparedSFT | None = None

    @classmethod
    def config_problems(cls, node: Any) -> list[str]:
        """Problems of a ``data`` config node, for `trainer.config.validate` (before any launch)."""
        problems = []
        sources = node.get("sources") if hasattr(node, "get") else None
        if not sources:
            return ["data.sources is empty; name at least one source, e.g. data.sources.general.source=alpaca"]
        for name, sub in sources.items():
            try:
                parse_source(str(name), dict(sub or {}))
            except ValueError as err:
                problems.append(str(err))
        if node.get("template", "auto") not in ("auto", "default", "tokenizer"):
            problems.append(f"data.template={node.get('template')!r}: use auto, default or tokenizer")
        if node.get("long_samples", "split") not in LONG_SAMPLES:
            problems.append(f"data.long_samples={node.get('long_samples')!r}: use one of {LONG_SAMPLES}")
        return problems

    # ------------------------------------------------------------------------------ preparation
    def _conversations(self, name: str) -> tuple[list[list[Message]], list[list[Message]]]:
        fields = self.fields[name]
        source, limit, val_size = fields["source"], fields["limit"], fields["val_size"]
        if source in synthetic.TASKS:
            sizes = {"train": limit or _SYNTHETIC_DEFAULT_SIZE, "val": val_size}
            made = synthetic.examples(source, seed=self.seed, sizes=sizes)
            return [synthetic.to_messages(e) for e in made["train"]], [synthetic.to_messages(e) for e in made["val"]]
        try:
            conversations = instructions.BUNDLED[source]() if source in instructions.BUNDLED else instructions.load_jsonl(source)
        except (FileNotFoundError, ValueError) as err:
            raise DataError(f"data.sources.{name}: {err}") from None
        train, val = _hash_split(conversations, val_size, self.seed, name)
        return (train[:limit] if limit else train), val

    def prepare(self) -> PreparedSFT:
        """Tokenizer, tokenized train/val samples per source and the packed validation rows (cached).

        Raises:
            DataError: missing data packages, a budget the epochs cannot reach, or a long sample
                under ``long_samples=error``.
        """
        if self._prepared is not None:
            return self._prepared
        convs = {name: self._conversations(name) for name in self.names}
        train_texts = ["".join(t for t, _ in default_segments(c)) for tr, _ in convs.values() for c in tr]
        tokenizer = load_or_train(
            path=self.tokenizer_path, texts=train_texts, vocab_size=self.vocab_size, cache_dir=self.cache_dir,
            corpus_fingerprint=_fingerprint("sft", *train_texts),
        )  # fmt: skip
        template = self._template(tokenizer)
        key = _fingerprint(json.dumps(convs, sort_keys=True), tokenizer.fingerprint, self.template_name, str(template is None))
        cache_file = self.cache_dir / f"sft-{key}.pt"
        if cache_file.exists():
            encoded = torch.load(cache_file, weights_only=False)
        else:
            encoded = {n: [encode_conversations(tokenizer, part, template) for part in convs[n]] for n in self.names}
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            torch.save(encoded, tmp)
            os.replace(tmp, cache_file)
        self.dropped: dict[str, dict[str, int]] = {}
        train = {n: SourceSamples(*self._apply_long_policy(n, encoded[n][0])) for n in self.names}
        val = {n: SourceSamples(*self._apply_long_policy(n, encoded[n][1], count=False)) for n in self.names}
        problems = Mixture(train, self.specs, seed=self.seed).check_reachable()
        if problems:
            raise DataError("; ".join(problems))
        for n, d in self.dropped.items():
            if d["samples"]:
                print(f"plait: data.sources.{n}: {d['samples']} samples longer than data.seq_len={self.seq_len} "
                      f"({self.long_samples}): {d['supervised_tokens']} supervised tokens dropped")  # fmt: skip
        prompts = {n: self._generation_set(convs[n][1], tokenizer, template) for n in self.names if self.fields[n]["metric"] == "exact_match"}
        self._prepared = PreparedSFT(tokenizer=tokenizer, template=template, train=train, val=val, prompts=prompts)
        return self._prepared

    def _template(self, tokenizer: Tokenizer) -> JinjaTemplate | None:
        if self.template_name == "default":
            return None
        template = load_chat_template(self.tokenizer_path, tokenizer)
        if template is None and self.template_name == "tokenizer":
            raise DataError(
                f"data.template=tokenizer but data.tokenizer={self.tokenizer_path} has no tokenizer_config.json with a "
                "chat_template beside it; use data.template=auto or default"
            )
        return template

    def _apply_long_policy(self, name: str, samples: list, count: bool = True) -> tuple[list, list]:
        ids_out, labels_out = [], []
        dropped = {"samples": 0, "supervised_tokens": 0}
        for ids, labels in samples:
            if len(ids) > self.seq_len and self.long_samples != "split":
                if self.long_samples == "error":
                    raise DataError(
                        f"data.sources.{name}: a sample of {len(ids)} tokens is longer than data.seq_len={self.seq_len}; "
                        "set data.long_samples=split (continue in the next row), truncate or drop, or raise data.seq_len"
                    )
                cut = 0 if self.long_samples == "drop" else self.seq_len
                dropped["samples"] += 1
                dropped["supervised_tokens"] += int(sum(1 for x in labels[cut:] if x != IGNORE_INDEX))
                ids, labels = ids[:cut], labels[:cut]
                if not ids:
                    continue
            ids_out.append(ids)
            labels_out.append(labels)
        if count:
            self.dropped[name] = dropped
        return ids_out, labels_out

    def _generation_set(self, val: list[list[Message]], tokenizer: Tokenizer, template: JinjaTemplate | None) -> dict[str, list]:
        prompts, answers = [], []
        for messages in val:
            if messages[-1]["role"] != "assistant":
                continue
            text = prompt_text(messages[:-1]) if template is None else template.render(messages[:-1], add_generation_prompt=True)
            prompts.append(tokenizer.encode(text))
            answers.append(messages[-1]["content"].strip())
        return {"prompts": prompts, "answers": answers}

    @property
    def tokenizer(self) -> Tokenizer:
        return self.prepare().tokenizer

    # ------------------------------------------------------------------------------ loaders
    def _make_packer(self, samples: dict[str, SourceSamples], specs: dict[str, SourceSpec]) -> MixturePacker:
        return MixturePacker(Mixture(samples, specs, seed=self.seed), seq_len=self.seq_len, pad_id=self.tokenizer.pad_id)

    def make_loader(self, dp_rank: int = 0, dp_size: int = 1) -> MixtureLoader:
        prepared = self.prepare()
        loader = MixtureLoader(
            lambda: self._make_packer(prepared.train, self.specs),
            names=self.names, global_batch_size=self.global_batch_size, dp_rank=dp_rank, dp_size=dp_size,
            dropped={n: d["supervised_tokens"] for n, d in self.dropped.items() if d["supervised_tokens"]},
        )  # fmt: skip
        return loader

    @override
    def setup(self, stage: str) -> None:
        self.prepare()

    @override
    def train_dataloader(self) -> MixtureLoader:
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.trainer else {"num_replicas": 1, "rank": 0}
        return self.make_loader(dp["rank"], dp["num_replicas"])

    def steps_per_epoch(self) -> int:
        return len(self.make_loader())

    def finite_steps(self) -> int:
        """Optimizer steps of one pass over the mixture (the run ends there)."""
        return len(self.make_loader())

    def eval_dataloader(self) -> DataLoader:
        """This dp rank's share of every source's held-out rows (``source_ids`` mark the source)."""
        prepared = self.prepare()
        val_specs = {n: SourceSpec(weight=1.0, max_tokens=None, max_epochs=1.0) for n in self.names}
        packer = self._make_packer(prepared.val, val_specs)
        rows = []
        while (row := packer.next_row()) is not None:
            rows.append(row)
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.trainer else {"num_replicas": 1, "rank": 0}
        per_rank = len(rows) // dp["num_replicas"]
        mine = rows[dp["rank"] * per_rank : (dp["rank"] + 1) * per_rank]
        tensors = rows_to_tensors(mine, num_rows=len(mine), seq_len=self.seq_len, pad_id=self.tokenizer.pad_id)
        dataset = [{k: v[i] for k, v in tensors.items()} for i in range(len(mine))]
        return DataLoader(dataset, batch_size=max(1, min(len(mine), 8)), shuffle=False)

    @torch.no_grad()
    def eval_metrics(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """Held-out exact match of the sources with ``metric: exact_match`` (``val/exact_match/<source>``).

        Every rank decodes every prompt (identical results; FSDP needs every rank in each forward)."""
        from trainer.generate import greedy_batch

        out = {}
        for name, gen in self.prepare().prompts.items():
            if not gen["prompts"]:
                continue
            tokenizer = self.tokenizer
            longest = max(len(tokenizer.encode(a)) for a in gen["answers"]) + 2
            new = greedy_batch(model, gen["prompts"], max_new_tokens=longest, eos_id=tokenizer.eos_id, device=device)
            hits = [tokenizer.decode(ids).strip() == answer for ids, answer in zip(new, gen["answers"])]
            out[f"val/exact_match/{name}"] = float(np.mean(hits))
        return out


def describe(data: SFTDataModule) -> dict[str, Any]:
    """Per-source sizes of the prepared data (samples, supervised tokens) for logs and reports."""
    prepared = data.prepare()
    return {
        n: {"train_samples": len(prepared.train[n]), "train_supervised_tokens": prepared.train[n].total_supervised()}
        for n in data.names
    }

