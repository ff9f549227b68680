"""Where a generated answer ends: the tokens and the text of a chat template's end of turn.

A tokenizer's EOS (``<|endoftext|>``) is not what a chat model emits when its answer is done: ChatML
templates close each assistant turn with ``<|im_end|>`` and Llama 3's with ``<|eot_id|>``, and never
write the EOS, so a model fine-tuned on their renderings stops with those. Generation (``plait chat``,
exact match, GRPO's rollouts, ReST's traces, lm-eval's ``generate_until``) stops at `turn_end_ids`
beside the EOS, and cuts at `turn_end_text` where the marker is spelled in several tokens; transformers
stops at the ids of ``generation_config.json``'s ``eos_token_id`` list alike.
"""

from __future__ import annotations

from trainer.data.chat import JinjaTemplate
from trainer.data.tokenizer import Tokenizer


def _marker(tokenizer: Tokenizer, template: JinjaTemplate) -> tuple[str, int | None]:
    """(the template's end-of-turn marker: `JinjaTemplate.turn_end` without surrounding whitespace;
    its first token when that is a special token of ``tokenizer``, else None)."""
    marker = template.turn_end().strip()
    first = tokenizer.encode(marker)[:1]
    return marker, first[0] if first and first[0] in tokenizer.special_ids else None


def turn_end_ids(tokenizer: Tokenizer, template: JinjaTemplate | None) -> tuple[int, ...]:
    """The special tokens besides EOS that end an answer under ``template``: the one its
    assistant turns end with (the first token of its end-of-turn marker, `JinjaTemplate.turn_end`:
    ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``) and its
    ``tokenizer_config.json``'s ``eos_token``, each where it is a special token of ``tokenizer``
    other than its EOS. Generation stops at these as at EOS, as transformers stops at the ids of
    ``generation_config.json``'s ``eos_token_id`` list. None (plait's default template, which ends
    each answer with EOS): none.
    """
    if template is None:
        return ()
    _, first = _marker(tokenizer, template)
    ids = [] if first is None else [first]
    if len(eos := tokenizer.encode(template.special.get("eos_token") or "")) == 1:
        ids += eos
    return tuple(dict.fromkeys(i for i in ids if i in tokenizer.special_ids and i != tokenizer.eos_id))


def turn_end_text(tokenizer: Tokenizer, template: JinjaTemplate | None) -> tuple[str, ...]:
    """The template's end-of-turn marker as text where it does not start with a special token of
    ``tokenizer`` (``<|im_end|>`` of a tokenizer that spells it in several tokens): decoding cannot
    stop at an id there, so completions are cut at the text (`trainer.rl.rollout.cut_at_stop`).
    () where a token stops it (`turn_end_ids`, or the EOS itself), where the template writes no
    marker, and for None.
    """
    if template is None:
        return ()
    marker, first = _marker(tokenizer, template)
    return (marker,) if marker and first is None else ()
