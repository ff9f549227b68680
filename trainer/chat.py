"""``plait chat ckpt=...``: a conversation with a run's model on stdin/stdout.

Each line read is a user message; the whole conversation so far is rendered with the run's chat
template (`trainer.generate.chat_template`, the one its data used and `plait export` writes),
the model answers with a KV cache until EOS, and the answer joins the conversation. Ends at EOF.

Invocation::

    plait chat ckpt=runs/sft temperature=0
    echo "What is 2+2?" | plait chat ckpt=runs/sft/checkpoints/step_0000100
"""

from __future__ import annotations

import sys

import torch

from trainer.compose import compose_command
from trainer.generate import chat_template, load_for_generation, reply


def main(argv: list[str]) -> None:
    """Entry of ``plait chat``: ``key=value`` arguments of conf/chat.yaml; exit 2 on bad input."""
    cfg = compose_command("chat", argv, usage="plait chat ckpt=<run or checkpoint dir>")
    run = load_for_generation(cfg.ckpt, cfg.trust)
    template = chat_template(run)
    torch.manual_seed(cfg.seed)
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        messages.append({"role": "user", "content": line.rstrip("\n")})
        answer = reply(run, template.render(messages, add_generation_prompt=True), cfg)
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
