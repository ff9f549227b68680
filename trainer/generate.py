"""``plait generate ckpt=... prompt="..."``: sample a continuation from a checkpoint (top-k,
temperature), with a KV cache, stopped at EOS; ``chat=true`` answers the prompt as a user message.

The prompt is any text: ``prompt=`` takes everything after its ``=`` as it is (commas, quotes,
apostrophes, ``$``; the shell's quoting is all it needs), ``prompt_file=PATH`` the whole file
(UTF-8, one prompt: a multi-line prompt keeps its lines; its final newline is dropped) and
``prompt=-`` the whole of stdin. For several prompts, run once per prompt, or use ``plait chat``
(one user message per line of stdin).

Invocation::

    plait generate ckpt=runs/pretrain prompt="To be"
    plait generate ckpt=runs/sft prompt="What's 2+2, exactly?" chat=true temperature=0
    plait generate ckpt=runs/sft prompt_file=question.txt chat=true
    echo "What's 2+2?" | plait generate ckpt=runs/sft prompt=- chat=true
"""

# The sampling itself is `trainer.sampling`; this module parses the arguments and loads the run.

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig

from strategies.checkpoint.dcp import CheckpointError
from trainer.compose import compose_command, fail
from trainer.data.answer_end import turn_end_ids, turn_end_text
from trainer.data.chat import ChatError, JinjaTemplate
from trainer.export import trained_chat_template
from trainer.init_from import load_init_from
from trainer.models.hf import HFError
from trainer.run_model import RunModel, load_run_model
from trainer.sampling import NonFiniteLogitsError, caches, continue_text, sample
from trainer.targets import UntrustedTargetError

TEXT_KEYS = ("prompt", "prompt_file")  # generate's arguments taken as raw text, never parsed by Hydra


def take_text(argv: Sequence[str], keys: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """(``key -> text`` of each ``key=text`` argument in ``keys``, the other arguments): the text is
    everything after the first ``=``, as the shell passed it. Hydra's override grammar would refuse
    an apostrophe or read a comma as a sweep (``prompt="What's 2+2?"``), so these never reach it.

    Raises:
        SystemExit: (exit 2, ``plait: error:``) a key given twice.
    """
    taken: dict[str, str] = {}
    rest = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in keys:
            if key in taken:
                fail(f"{key}= is given twice; give it once")
            taken[key] = value
        else:
            rest.append(arg)
    return taken, rest


def read_text(path: str, what: str) -> str:
    """The text of ``path`` (``-``: stdin), UTF-8, without one final newline.

    Raises:
        SystemExit: (exit 2, ``plait: error:``) the file is missing or not UTF-8 text.
    """
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).expanduser().read_bytes()
        text = data.decode("utf-8")
    except OSError as err:
        fail(f"{what}={path}: {err.strerror or err}; give an existing file (or {what}=- for stdin)")
    except UnicodeDecodeError as err:
        fail(
            f"{what}={path} is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); convert it (iconv -t UTF-8)"
        )
    return text.removesuffix("\n").removesuffix("\r")


def prompt_of(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the prompt ``prompt=``, ``prompt=-`` or ``prompt_file=`` gives, None without one; the other
    arguments, for Hydra).

    Raises:
        SystemExit: (exit 2, ``plait: error:``) both ``prompt`` and ``prompt_file``, or an unreadable file.
    """
    taken, rest = take_text(argv, TEXT_KEYS)
    if len(taken) == 2:
        fail("prompt= and prompt_file= are both given; give one (prompt=- reads stdin)")
    if "prompt_file" in taken:
        return read_text(taken["prompt_file"], "prompt_file"), rest
    if taken.get("prompt") == "-":
        return read_text("-", "prompt"), rest
    return taken.get("prompt"), rest


def load_for_generation(ckpt: str, trust: Sequence[str] = ()) -> RunModel:
    """The run's model and tokenizer (`load_run_model`); says on stderr which checkpoint it loaded.

    Args:
        trust: packages besides plait whose classes the run's config.yaml may build.

    Raises:
        SystemExit: (exit 2, ``plait: error:``) no intact checkpoint, a config target outside
            plait and ``trust``, an unsafe or non-finite checkpoint, or the run has no tokenizer.
    """
    try:
        run = load_run_model(
            ckpt, load_base=load_init_from, trust=trust, report=lambda line: print(f"plait: {line}", file=sys.stderr)
        )
    except FileNotFoundError as err:
        fail(f"ckpt={err}")
    except HFError as err:
        fail(f"ckpt={ckpt}: {err}")
    except (UntrustedTargetError, CheckpointError) as err:
        fail(str(err))
    if run.tokenizer is None:
        fail(f"ckpt={ckpt}: {run.run.tokenizer} is missing; generation needs the run's tokenizer")
    print(f"plait: loaded {run.checkpoint}", file=sys.stderr)
    return run


def chat_template(run: RunModel) -> JinjaTemplate:
    """The chat template the run trained with (`trainer.export.trained_chat_template`, the one
    `plait export` writes); says on stderr which, and when its end-of-turn marker is several tokens
    of the run's tokenizer (answers are cut at its text: `reply`).

    Raises:
        SystemExit: (exit 2, ``plait: error:``) the run's template files are unusable.
    """
    try:
        template = trained_chat_template(run)
    except ChatError as err:
        fail(f"{run.run.path}: {err}")
    print(f"plait: chat template: {template.origin}", file=sys.stderr)
    if marker := turn_end_text(run.tokenizer, template):
        print(
            f"plait: the template's end of turn {marker[0]!r} is several tokens of this tokenizer: answers are cut at its text",
            file=sys.stderr,
        )
    return template


def reply(run: RunModel, text: str, cfg: DictConfig, template: JinjaTemplate | None = None) -> str:
    """The model's continuation of ``text`` (sampled as ``cfg`` says, stopped at EOS, and with a
    chat ``template`` at its end of turn: its token, `trainer.data.answer_end.turn_end_ids`, or its
    text where the tokenizer spells it in several tokens, `turn_end_text`), decoded; says on
    stderr when the model's context (``max_seq_len``: a windowed checkpoint's window) will stop it
    first, or cut the prompt's start."""
    if (line := context_line(len(run.tokenizer.encode(text)), cfg.max_new_tokens, run.model.max_seq_len)) is not None:
        print(f"plait: {line}", file=sys.stderr)
    return continue_text(
        run.model,
        run.tokenizer,
        text,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        stop_ids=turn_end_ids(run.tokenizer, template),
        stop_text=turn_end_text(run.tokenizer, template),
        use_cache=cfg.kv_cache,
    )


def context_line(prompt_tokens: int, max_new_tokens: int, context: int) -> str | None:
    """The note for a prompt and ``max_new_tokens`` that do not fit the model's ``context`` tokens
    (`trainer.sampling.sample` keeps the prompt's last ``context - 1`` tokens and stops when the
    context is full); None when they fit."""
    if prompt_tokens + max_new_tokens <= context:
        return None
    cut = f"; its first {prompt_tokens - context + 1} prompt tokens are dropped" if prompt_tokens >= context else ""
    room = max(1, context - prompt_tokens)
    return (
        f"the prompt's {prompt_tokens} tokens and max_new_tokens={max_new_tokens} exceed the model's context of "
        f"{context} tokens (model.max_seq_len; a windowed checkpoint's window): at most {room} new tokens{cut}"
    )


def main(argv: list[str]) -> None:
    """Entry of ``plait generate``: ``key=value`` arguments of conf/generate.yaml; exit 2 on bad input.

    ``chat=true`` sends the prompt as one user message through the run's chat template and prints
    the answer alone (stopped at EOS or the template's end of turn); otherwise the prompt is
    continued as text, stopped at EOS. The
    prompt (``prompt=``, ``prompt_file=``, ``prompt=-``) is read before Hydra sees the rest
    (`prompt_of`)."""
    given, rest = prompt_of(argv)
    cfg = compose_command(
        "generate", rest, usage='plait generate ckpt=<run or checkpoint dir> prompt="..."', ranges=sample
    )
    prompt = cfg.prompt if given is None else given
    run = load_for_generation(cfg.ckpt, cfg.trust)
    if cfg.kv_cache and not caches(run.model):
        print(
            f"plait: {type(run.model).__name__} has no set_attention_core: generating without a KV cache",
            file=sys.stderr,
        )
    torch.manual_seed(cfg.seed)
    try:
        if cfg.chat:
            template = chat_template(run)
            try:
                text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
            except ChatError as err:
                fail(str(err))
            print(reply(run, text, cfg, template))
        else:
            print(prompt + reply(run, prompt, cfg))
    except NonFiniteLogitsError as err:
        fail(f"{run.checkpoint}: {err}")
