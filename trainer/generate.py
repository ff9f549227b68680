"""``plait generate ckpt=... prompt="..."``: sample a continuation from a checkpoint (top-k, temperature)."""

from __future__ import annotations

import torch
from torch import nn

from trainer.compose import compose_command, fail
from trainer.rundir import load_run_model


@torch.no_grad()
def sample(
    model: nn.Module, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int | None, max_seq_len: int
) -> list[int]:
    """Autoregressive sampling without a KV cache (the context is re-run each token; fine for small models).

    Args:
        prompt_ids: token ids of the prompt (at least one).
        temperature: softmax temperature; 0 means greedy.
        top_k: sample among the k most likely tokens (None or 0: all).
        max_seq_len: context window; older tokens are dropped.

    Returns:
        The generated ids (without the prompt).
    """
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids[:, -max_seq_len:])[0, -1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits, -1), 1))
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


@torch.no_grad()
def greedy_batch(
    model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, eos_id: int, device: torch.device | str = "cpu"
) -> list[list[int]]:
    """Greedy continuations of many prompts at once (no KV cache), each stopped at its first EOS.

    Prompts are left-padded; the padding is a document of its own (``document_ids`` 0, the
    prompt 1) and positions start at 0 at each prompt, so every row computes exactly what it
    would alone.

    Args:
        prompts: token ids per prompt (each non-empty); prompt + ``max_new_tokens`` must fit the
            model's context.

    Returns:
        The generated ids per prompt, without the prompt and without the EOS.
    """
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    docs = torch.zeros_like(ids)
    pos = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        docs[i, width - len(p) :] = 1
        pos[i, width - len(p) :] = torch.arange(len(p))
        pos[i, : width - len(p)] = torch.arange(width - len(p))
    ids, docs, pos = ids.to(device), docs.to(device), pos.to(device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out = []
    for _ in range(max_new_tokens):
        logits = model(ids, position_ids_bt=pos, document_ids_bt=docs)[:, -1].float()
        next_ids = logits.argmax(-1)
        out.append(torch.where(done, torch.full_like(next_ids, eos_id), next_ids))
        done |= next_ids == eos_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, next_ids[:, None]], 1)
        docs = torch.cat([docs, torch.ones_like(next_ids)[:, None]], 1)
        pos = torch.cat([pos, pos[:, -1:] + 1], 1)
    generated = torch.stack(out, 1).tolist() if out else [[] for _ in prompts]
    return [row[: row.index(eos_id)] if eos_id in row else row for row in generated]


def main(argv: list[str]) -> None:
    """Entry of ``plait generate``: ``key=value`` arguments of conf/generate.yaml; exit 2 on bad input."""
    cfg = compose_command("generate", argv, usage='plait generate ckpt=<run or checkpoint dir> prompt="..."')
    try:
        run = load_run_model(cfg.ckpt)
    except FileNotFoundError as err:
        fail(f"ckpt={err}")
    model, tokenizer = run.model, run.tokenizer
    if tokenizer is None:
        fail(f"ckpt={cfg.ckpt}: {run.run.tokenizer} is missing; generate needs the run's tokenizer")
    torch.manual_seed(cfg.seed)
    prompt_ids = tokenizer.encode(cfg.prompt) or [tokenizer.eos_id]
    new_ids = sample(
        model,
        prompt_ids,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        max_seq_len=model.max_seq_len,
    )
    print(cfg.prompt + tokenizer.decode(new_ids))
