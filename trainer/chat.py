"""``plait chat ckpt=...``: a conversation with a run's model on stdin/stdout.

Each line read is a user message; the whole conversation so far is rendered with the run's chat
template (`trainer.generate.chat_template`, the one its data used and `plait export` writes),
the model answers with a KV cache until EOS or the template's end of turn (ChatML's
``<|im_end|>``: `trainer.data.answer_end.turn_end_ids`), and the answer joins the conversation. Ends at EOF.
``system=`` takes any text as typed (commas, quotes, apostrophes), as ``plait generate``'s prompt.

Invocation::

    plait chat ckpt=runs/sft temperature=0 system="You're terse, and exact."
    echo "What is 2+2?" | plait chat ckpt=runs/sft/checkpoints/step_0000100
"""

from __future__ import annotations

import itertools
import sys

import torch

from trainer.compose import compose_command, fail
from trainer.data.chat import ChatError
from trainer.generate import chat_template, load_for_generation, reply, take_text
from trainer.sampling import NonFiniteLogitsError, sample


def user_text(line: bytes, number: int) -> str:
    """The text of stdin's line ``number`` (1-based), without its line ending.

    Raises:
        SystemExit: (exit 2, ``plait: error:``) the line is not UTF-8.
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        fail(
            f"stdin line {number} is not UTF-8 text (byte {line[err.start]:#04x} at offset {err.start}); convert it to UTF-8 (iconv -t UTF-8)"
        )
    return text.removesuffix("\n").removesuffix("\r")


def main(argv: list[str]) -> None:
    """Entry of ``plait chat``: ``key=value`` arguments of conf/chat.yaml; exit 2 on bad input."""
    given, rest = take_text(argv, ("system",))  # any text: Hydra's grammar never sees it
    cfg = compose_command("chat", rest, usage="plait chat ckpt=<run or checkpoint dir>", ranges=sample)
    system = given.get("system", cfg.system)
    run = load_for_generation(cfg.ckpt, cfg.trust)
    template = chat_template(run)
    torch.manual_seed(cfg.seed)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    for number in itertools.count(1):
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.buffer.readline()
        if not line:
            return
        text = user_text(line, number)
        if not text.strip():  # an empty line is no turn: the model would answer nothing asked
            continue
        messages.append({"role": "user", "content": text})
        try:
            text = template.render(messages, add_generation_prompt=True)
        except ChatError as err:
            fail(str(err))
        try:
            answer = reply(run, text, cfg, template)
        except NonFiniteLogitsError as err:  # as plait generate: one error line, exit 2
            fail(f"{run.checkpoint}: {err}")
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
