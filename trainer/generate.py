"""``plait generate ckpt=... prompt="..."``: sample a continuation from a checkpoint (top-k,
temperature), with a KV cache, stopped at EOS; ``chat=true`` answers the prompt as a user message.
The sampling itself is `trainer.sampling`; this module parses the arguments and loads the run.

Invocation::

    plait generate ckpt=runs/pretrain prompt="To be"
    plait generate ckpt=runs/sft prompt="What is 2+2?" chat=true temperature=0
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from omegaconf import DictConfig

from strategies.checkpoint.dcp import CheckpointError
from trainer.compose import compose_command, fail
from trainer.data.chat import ChatError, JinjaTemplate
from trainer.export import trained_chat_template
from trainer.init_from import load_init_from
from trainer.models.hf import HFError
from trainer.rundir import RunModel, load_run_model
from trainer.sampling import NonFiniteLogitsError, caches, continue_text, sample
from trainer.targets import UntrustedTargetError


def load_for_generation(ckpt: str, trust: Sequence[str] = ()) -> RunModel:
    """The run's model and tokenizer (`load_run_model`); says on stderr which checkpoint it loaded.

    Args:
        trust: packages besides plait whose classes the run's config.yaml may build.

    Raises:
        SystemExit: (exit 2, ``plait: error:``) no intact checkpoint, a config target outside
            plait and ``trust``, an unsafe or non-finite checkpoint, or the run has no tokenizer.
    """
    try:
        run = load_run_model(ckpt, load_base=load_init_from, trust=trust)
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
    `plait export` writes); says on stderr which.

    Raises:
        SystemExit: (exit 2, ``plait: error:``) the run's template files are unusable.
    """
    try:
        template = trained_chat_template(run)
    except ChatError as err:
        fail(f"{run.run.path}: {err}")
    print(f"plait: chat template: {template.origin}", file=sys.stderr)
    return template


def reply(run: RunModel, text: str, cfg: DictConfig) -> str:
    """The model's continuation of ``text`` (sampled as ``cfg`` says, stopped at EOS), decoded."""
    return continue_text(
        run.model,
        run.tokenizer,
        text,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        use_cache=cfg.kv_cache,
    )


def main(argv: list[str]) -> None:
    """Entry of ``plait generate``: ``key=value`` arguments of conf/generate.yaml; exit 2 on bad input.

    ``chat=true`` sends the prompt as one user message through the run's chat template and prints
    the answer alone; otherwise the prompt is continued as text. Generation stops at EOS."""
    cfg = compose_command(
        "generate", argv, usage='plait generate ckpt=<run or checkpoint dir> prompt="..."', ranges=sample
    )
    run = load_for_generation(cfg.ckpt, cfg.trust)
    if cfg.kv_cache and not caches(run.model):
        print(
            f"plait: {type(run.model).__name__} has no set_attention_core: generating without a KV cache",
            file=sys.stderr,
        )
    torch.manual_seed(cfg.seed)
    try:
        if cfg.chat:
            print(
                reply(
                    run,
                    chat_template(run).render([{"role": "user", "content": cfg.prompt}], add_generation_prompt=True),
                    cfg,
                )
            )
        else:
            print(cfg.prompt + reply(run, cfg.prompt, cfg))
    except NonFiniteLogitsError as err:
        fail(f"{run.checkpoint}: {err}")
