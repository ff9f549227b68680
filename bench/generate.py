"""Generation speed: 40 greedy tokens of the nano Llama with and without the KV cache, side by side.

A second pair times `trainer.batch_sampling.sample_batch` (the RL rollout sampler) on ``--batch`` prompts
of 1..``--prompt`` tokens (left-padded), seeded, at temperature 1, with and without its cache;
the tokens of both arms are checked equal, and the ratio is printed on a ``BATCH`` line.

The model is ``conf/model/nano.yaml`` (random weights; speed does not depend on them) with the
default tokenizer's 4096 ids. Both arms run `trainer.sampling.sample` in this process, interleaved
(``--repeats`` rounds, the best of each arm), so contention hits both; the tokens of both arms are
checked equal. Load and import time are not included (``plait generate`` adds them).

Invocation::

    python bench/generate.py                  # ~10 s on an idle 2-core machine
    python bench/generate.py --tokens 100 --prompt 60

The last two lines are ``BATCH kv_s=<s> no_cache_s=<s> speedup=<x> rows=<n> tokens=<n>`` and ``RESULT kv_s=<s> no_cache_s=<s> speedup=<x> tokens=<n>``.
"""

from __future__ import annotations

import argparse
import time

import torch
from omegaconf import OmegaConf

from trainer.batch_sampling import sample_batch
from trainer.compose import CONF_DIR
from trainer.model_node import instantiate_model
from trainer.sampling import sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=8, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="prompts of sample_batch (0: skip it)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = instantiate_model(OmegaConf.load(CONF_DIR / "model" / "nano.yaml"), vocab_size=4096).eval()
    prompt = torch.randint(0, 4096, (args.prompt,)).tolist()
    kw = {"max_new_tokens": args.tokens, "temperature": 0.0, "top_k": None, "max_seq_len": model.max_seq_len}
    best = {True: float("inf"), False: float("inf")}
    tokens = {}
    for _ in range(args.repeats):
        for use_cache in (True, False):
            start = time.perf_counter()
            tokens[use_cache] = sample(model, prompt, use_cache=use_cache, **kw)
            best[use_cache] = min(best[use_cache], time.perf_counter() - start)
    assert tokens[True] == tokens[False], "the KV cache changed the greedy tokens"
    if args.batch:
        _batch(model, args)
    print(
        f"{args.tokens} tokens after a {args.prompt}-token prompt: KV cache {best[True]:.3f} s, none {best[False]:.3f} s"
    )
    print(
        f"RESULT kv_s={best[True]:.4f} no_cache_s={best[False]:.4f} speedup={best[False] / best[True]:.2f} tokens={len(tokens[True])}"
    )


def _batch(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Times `sample_batch` with and without its KV cache (interleaved, best of ``--repeats``)."""
    prompts = [
        torch.randint(0, 4096, (1 + i * (args.prompt - 1) // max(args.batch - 1, 1),)).tolist()
        for i in range(args.batch)
    ]
    kw = {"max_new_tokens": args.tokens, "eos_id": None, "temperature": 1.0, "seeds": list(range(args.batch))}
    best = {True: float("inf"), False: float("inf")}
    rows = {}
    for _ in range(args.repeats):
        for use_cache in (True, False):
            start = time.perf_counter()
            rows[use_cache] = sample_batch(model, prompts, use_cache=use_cache, **kw)
            best[use_cache] = min(best[use_cache], time.perf_counter() - start)
    assert rows[True] == rows[False], "the KV cache changed sample_batch's tokens"
    print(
        f"sample_batch, {args.batch} prompts of 1..{args.prompt} tokens, {args.tokens} tokens each: "
        f"KV cache {best[True]:.3f} s, none {best[False]:.3f} s"
    )
    print(
        f"BATCH kv_s={best[True]:.4f} no_cache_s={best[False]:.4f} speedup={best[False] / best[True]:.2f} "
        f"rows={args.batch} tokens={sum(map(len, rows[True]))}"
    )


if __name__ == "__main__":
    main()
