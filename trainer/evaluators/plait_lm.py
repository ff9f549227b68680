"""`PlaitLM`: plait's models as an ``lm_eval.api.model.TemplateLM`` (EleutherAI's
lm-evaluation-harness): the harness hands it requests and it answers them with a plait model and
tokenizer, in one process or on every rank of a training run (each rank answers every request: an
FSDP forward needs every rank). `trainer.evaluators.lm_harness.evaluate_tasks` runs tasks with it.

What each request type computes, as lm-eval's own ``HFLM`` does (``lm_eval/models/huggingface.py``):

- ``loglikelihood`` (context, continuation): the sum of the continuation's token log-probabilities
  given the context, and whether greedy decoding would produce it. The model reads
  ``(context + continuation)[-(L + 1):][:-1]`` (L: ``max_length``), so a long context loses its left.
  An empty context is replaced by `prefix_token_id` (the EOS that separates plait's documents).
- ``loglikelihood_rolling`` (text): the text's whole log-probability in disjoint windows of L tokens,
  each after as much of the text before it as fits (``lm_eval.utils.get_rolling_token_windows``).
- ``generate_until`` (context, gen_kwargs): greedy (or sampled: ``do_sample``, ``temperature``,
  ``top_k``, ``top_p``) continuation with the KV cache (`trainer.batch_sampling.sample_batch`), at most
  ``max_gen_toks`` tokens (or its aliases; 256 by default), stopped at EOS, decoded without special
  tokens, then cut before the first stop string of ``until``. The context keeps its last
  ``max(L - max_gen_toks, L // 2)`` tokens (a warning counts the prompts cut), and generation stops
  at the context's end.

A tokenizer that prepends a BOS (Llama 3, Gemma) gets it before every text and as the empty
context, as ``HFLM`` does with the tokenizer's default; plait's own tokenizers prepend nothing.

Rows of a batch are right-padded: a causal model's logits at a position do not depend on what
follows it, so padding changes no score.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.batch_sampling import PAD_ID, sample_batch
from trainer.data.tokenizer import Tokenizer
from trainer.sampling import caches

DEFAULT_MAX_GEN_TOKS = 256


class PlaitLM(TemplateLM):
    """A plait model and tokenizer as an lm-eval ``LM`` (see the module docstring for what each
    request type computes).

    Args:
        model: a decoder taking ``[B, T]`` token ids and returning logits ``[B, T, V]`` (a plait
            ``Llama`` or ``MoETransformer``; FSDP-wrapped during training), with ``max_seq_len``.
        tokenizer: plait's tokenizer of the model.
        device: where the model's weights are.
        batch_size: requests per forward.
        max_length: the context L (default: ``model.max_seq_len``).
        chat_template: renders a conversation (``messages, add_generation_prompt`` -> text) for
            ``apply_chat_template``; None: the harness cannot apply one (lm-eval says so).
        all_done: for `sample_batch` on data-parallel ranks whose forwards are collective (see there).
        stop_ids: tokens besides EOS that end a generation (the chat template's end of turn,
            `trainer.data.answer_end.turn_end_ids`: ChatML's ``<|im_end|>``).
        kv_cache: decode with the KV cache when the model takes one (False: rerun the context per token).

    Raises:
        ValueError: ``batch_size`` or ``max_length`` below 1.
    """

    backend = "causal"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        device: torch.device | str = "cpu",
        batch_size: int = 16,
        max_length: int | None = None,
        chat_template: Callable[[list[dict[str, str]], bool], str] | None = None,
        all_done: Callable[[bool], bool] | None = None,
        stop_ids: Sequence[int] = (),
        kv_cache: bool = True,
    ) -> None:
        super().__init__()
        max_length = max_length or model.max_seq_len
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size={batch_size} and max_length={max_length} must be at least 1")
        self.model, self.plait_tokenizer, self._device = model, tokenizer, torch.device(device)
        self.batch_size, self.max_length = batch_size, max_length
        self._chat_template, self._all_done, self._kv_cache = chat_template, all_done, kv_cache
        self._stop_ids = tuple(stop_ids)
        # lm-eval's HF model class adds the BOS a tokenizer prepends (Llama 3, Gemma: the tokenizer's
        # default) and conditions empty contexts on it.
        self._bos_id = tokenizer.prepended_bos

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        """The tokenizer's EOS (plait's document separator)."""
        return self.plait_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: the BOS the tokenizer prepends, else EOS (as lm-eval's HFLM)."""
        return self.eot_token_id if self._bos_id is None else self._bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; the tokenizer's BOS first when it prepends one, ``add_special_tokens``
        is not False and ``string`` does not already start with it (HFLM's ``tok_encode``). plait's
        own tokenizers prepend nothing."""
        ids = self.plait_tokenizer.encode(string)
        if self._bos_id is None or add_special_tokens is False or ids[:1] == [self._bos_id]:
            return ids
        return [self._bos_id, *ids]

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's fingerprint (lm-eval keys its request cache with it)."""
        return f"plait-{self.plait_tokenizer.fingerprint}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """A name for the run's template (lm-eval records it); the rendering is `apply_chat_template`."""
        return "plait" if self._chat_template is not None else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the run's chat template.

        ``add_generation_prompt=False`` with an assistant message last (lm-eval's prefill) renders
        the conversation before it with the assistant's turn opened, then that message's text.

        Raises:
            NotImplementedError: this adapter was given no template.
        """
        if self._chat_template is None:
            raise NotImplementedError("this run has no chat template; evaluate without apply_chat_template")
        if not add_generation_prompt and chat_history and chat_history[-1]["role"] == "assistant":
            # lm-eval's assistant prefill (a task's gen_prefix): the answer continues that text, with no
            # end of turn after it (transformers' continue_final_message).
            return self._chat_template(chat_history[:-1], True) + chat_history[-1]["content"]
        return self._chat_template(chat_history, add_generation_prompt)

    # ------------------------------------------------------------------ scoring
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits ``[B, T, V]`` of right-padded ``rows`` (T: the longest), in the model's dtype."""
        width = max(len(r) for r in rows)
        ids_bt = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
        for i, r in enumerate(rows):
            ids_bt[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        logits = self.model(ids_bt.to(self._device))
        if isinstance(logits, DTensor):  # tensor parallel without sequence parallel: vocab-sharded logits
            logits = logits.full_tensor()
        return logits

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probabilities, whether greedy decoding gives it)`` per
        ``(key, context ids, continuation ids)``, in order; batches of similar lengths."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            rows, conts = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError(f"request {requests[i][0]!r} has an empty continuation: nothing to score")
                rows.append((context + continuation)[-(self.max_length + 1) :][:-1])
                conts.append(continuation[-self.max_length :])
            logits_btv = self._logits(rows)
            for b, (i, row, cont) in enumerate(zip(chunk, rows, conts)):
                # Only the continuation's positions, in float32: no [B, T, V] copy of the whole batch.
                logp_cv = logits_btv[b, len(row) - len(cont) : len(row)].float().log_softmax(-1)
                target = torch.tensor(cont, device=logp_cv.device)
                score = logp_cv.gather(-1, target[:, None]).sum().item()
                greedy = bool((logp_cv.argmax(-1) == target).all())
                out[i] = (score, greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], (score, greedy))
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The whole log-probability of each request's text (disjoint windows of ``max_length``)."""
        windows, owner = [], []
        for r, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (score, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[r] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation (see the module docstring); requests sharing generation
        settings (normalised as lm-eval's ``normalize_gen_kwargs`` does: ``max_new_tokens`` and the
        other aliases, ``temperature`` > 0 without ``do_sample`` samples) decode together,
        ``batch_size`` at a time."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, tuple[dict[str, Any], list[int]]] = {}
        for i, req in enumerate(requests):
            settings = dict(normalize_gen_kwargs(dict(req.args[1]), DEFAULT_MAX_GEN_TOKS))
            groups.setdefault(json.dumps(settings, sort_keys=True, default=str), (settings, []))[1].append(i)
        cut = 0
        for settings, members in groups.values():
            until, max_gen = list(settings.pop("until")), int(settings.pop("max_gen_toks"))
            sampled = bool(settings.pop("do_sample")) and float(settings.get("temperature") or 0.0) > 0
            unknown = set(settings) - {"temperature", "top_k", "top_p"}
            if unknown:
                logging.getLogger(__name__).warning("generation settings %s are not used by plait", sorted(unknown))
            # The prompt keeps at least half the context: a task's 256 new tokens do not leave a
            # 256-token model one token of it (HFLM refuses max_gen_toks >= max_length instead).
            keep = max(self.max_length - max_gen, self.max_length // 2)
            encoded = {i: self.tok_encode(requests[i].args[0]) or [self.prefix_token_id] for i in members}
            members.sort(key=lambda i: -len(encoded[i]))
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                prompts = [encoded[i][-keep:] for i in chunk]
                cut += sum(len(encoded[i]) > keep for i in chunk)
                new_ids = sample_batch(
                    self.model,
                    prompts,
                    max_new_tokens=min(max_gen, self.max_length - max(len(p) for p in prompts)),
                    eos_id=self.eot_token_id,
                    stop_ids=self._stop_ids,
                    temperature=float(settings["temperature"]) if sampled else 0.0,
                    top_k=int(settings["top_k"]) if sampled and settings.get("top_k") else None,
                    top_p=float(settings.get("top_p") or 1.0) if sampled else 1.0,
                    use_cache=self._kv_cache and caches(self.model),
                    device=self._device,
                    all_done=self._all_done,
                )
                for i, ids in zip(chunk, new_ids):
                    text = _cut(self.plait_tokenizer.decode(ids, skip_special_tokens=True), until)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        if cut:
            logging.getLogger(__name__).warning(
                "%d of %d generation prompts were cut from the left to leave room for the answer in the "
                "%d-token context; a larger max_length (up to the model's max_seq_len) keeps them whole",
                cut, len(requests), self.max_length,
            )  # fmt: skip
        return out  # type: ignore[return-value]


def _cut(text: str, until: Sequence[str]) -> str:
    """``text`` up to (without) the earliest of the stop strings ``until``."""
    ends = [text.find(s) for s in until if s and s in text]
    return text[: min(ends)] if ends else text
