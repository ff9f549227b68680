"""Generation speed: 40 greedy tokens of the nano Llama with and without the KV cache, side by side.

The model is ``conf/model/nano.yaml`` (random weights; speed does not depend on them) with the
default tokenizer's 4096 ids. Both arms run `trainer.sampling.sample` in this process, interleaved
(``--repeats`` rounds, the best of each arm), so contention hits both; the tokens of both arms are
checked equal. Load and import time are not included (``plait generate`` adds them).

Invocation::

    python bench/generate.py                  # ~10 s on an idle 2-core machine
    python bench/generate.py --tokens 100 --prompt 60

The last line is ``RESULT kv_s=<s> no_cache_s=<s> speedup=<x> tokens=<n>``.
"""

from __future__ import annotations

import argparse
import time

import torch
from omegaconf import OmegaConf

from trainer.compose import CONF_DIR
from trainer.model_node import instantiate_model
from trainer.sampling import sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=8, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=3)
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
    print(
        f"{args.tokens} tokens after a {args.prompt}-token prompt: KV cache {best[True]:.3f} s, none {best[False]:.3f} s"
    )
    print(
        f"RESULT kv_s={best[True]:.4f} no_cache_s={best[False]:.4f} speedup={best[False] / best[True]:.2f} tokens={len(tokens[True])}"
    )


if __name__ == "__main__":
    main()
