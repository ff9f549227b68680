"""Generation: the KV cache decodes the same tokens as rerunning the context, EOS stops it, and an
export carries the chat template, so ``transformers`` renders and generates what plait does."""

from __future__ import annotations

import time

import pytest
import torch

from trainer.data.chat import DEFAULT_CHAT_TEMPLATE, JinjaTemplate, default_segments, prompt_text
from trainer.models.llama import Llama
from trainer.sampling import NonFiniteLogitsError, sample

VOCAB = 300


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128).eval()
    with torch.no_grad():  # larger weights than the init: a random model whose greedy path varies
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(std=0.2)
    return model


PROMPT = [5, 17, 42, 99, 3, 250, 8]


def test_kv_cache_decodes_the_same_tokens_and_is_faster() -> None:
    model = _model()
    kw = {"max_new_tokens": 40, "temperature": 0.0, "top_k": None, "max_seq_len": model.max_seq_len}
    start = time.perf_counter()
    cached = sample(model, PROMPT, use_cache=True, **kw)
    middle = time.perf_counter()
    uncached = sample(model, PROMPT, use_cache=False, **kw)
    end = time.perf_counter()
    assert cached == uncached and len(cached) == 40
    assert len(set(cached)) > 3, "a varied sequence, not one repeated token"
    print(f"40 tokens: kv cache {middle - start:.3f} s, no cache {end - middle:.3f} s")
    # Both stop when the context is full.
    long = sample(model, PROMPT, use_cache=True, **{**kw, "max_new_tokens": 500})
    assert len(PROMPT) + len(long) == model.max_seq_len
    assert long == sample(model, PROMPT, use_cache=False, **{**kw, "max_new_tokens": 500})


def test_generation_stops_at_eos() -> None:
    model = _model()
    kw = {"max_new_tokens": 40, "temperature": 0.0, "top_k": None, "max_seq_len": model.max_seq_len}
    free = sample(model, PROMPT, **kw)
    k = next(i for i, t in enumerate(free) if i > 0 and t not in free[:i])
    for use_cache in (True, False):
        assert sample(model, PROMPT, eos_id=free[k], use_cache=use_cache, **kw) == free[:k]


def test_default_chat_template_is_the_trained_text() -> None:
    messages = [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again?"},
    ]  # fmt: skip
    template = JinjaTemplate(DEFAULT_CHAT_TEMPLATE, eos_token="<|endoftext|>")
    trained = "".join(
        text + ("<|endoftext|>" if supervised else "") for text, supervised in default_segments(messages[:3])
    )
    assert template.render(messages[:3]) == trained
    assert template.render(messages, add_generation_prompt=True) == trained + prompt_text(messages[3:])


def test_export_has_a_chat_template_transformers_uses(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from hf_checkpoints import corpus_texts

    from trainer.data.tokenizer import train_bpe
    from trainer.export import write_hf_dir

    model, tokenizer = _model(), train_bpe(corpus_texts(), vocab_size=VOCAB)
    out = write_hf_dir(tmp_path / "hf", model=model, state=model.state_dict(), tokenizer=tokenizer, sources=[])
    messages = [{"role": "user", "content": "thou art"}]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == prompt_text(messages)
    ids = tokenizer.encode(text)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    generated = hf_model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids) :].tolist()
    plait_ids = sample(
        model, ids, max_new_tokens=20, temperature=0.0, top_k=None, max_seq_len=128, eos_id=tokenizer.eos_id
    )
    assert generated[: len(plait_ids)] == plait_ids


def test_overflowing_logits_name_the_fix_instead_of_a_multinomial_traceback() -> None:
    # Finite but huge weights (a diverged run's checkpoint is finite, so it loads): the logits overflow.
    model = _model()
    with torch.no_grad():
        model.output.weight.fill_(3e38)
    kw = {"max_new_tokens": 4, "top_k": None, "max_seq_len": model.max_seq_len}
    for temperature in (0.0, 0.8):
        with pytest.raises(NonFiniteLogitsError, match="earlier checkpoint"):
            sample(model, PROMPT, temperature=temperature, **kw)
    # Finite logits that only a tiny temperature makes overflow.
    with pytest.raises(NonFiniteLogitsError, match="temperature=1e-40"):
        sample(_model(), PROMPT, temperature=1e-40, **kw)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("max_new_tokens=-5", "max_new_tokens=-5 must be > 0"),
        ("temperature=-1", "temperature=-1 must be >= 0"),
        ("top_k=0", "top_k=0 must be > 0"),
        ("max_new_tokens=1.5", "max_new_tokens=1.5 must be a whole number, e.g. max_new_tokens=100"),  # 2 tokens before
        ("top_k=2.5", "top_k=2.5 must be a whole number, e.g. top_k=40"),
    ],
)
def test_sampling_options_out_of_range_are_refused_before_loading(option: str, message: str, capsys) -> None:
    """`sample`'s declared ranges hold for ``plait generate``'s options, checked before the checkpoint loads."""
    from trainer.generate import main

    with pytest.raises(SystemExit) as exited:
        main(["ckpt=no_such_run", option])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(f"plait: error: {message} (usage: plait generate")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_top_k_null_samples_from_every_token(command: str) -> None:
    """``top_k=null`` (what `sample` documents as every token, and GRPO's preset uses) is taken;
    it was refused as "must be a number" (a reviewer's). Mutation: no nullable kinds -> SystemExit."""
    from trainer.compose import compose_command

    cfg = compose_command(command, ["ckpt=run", "top_k=null"], usage="", ranges=sample)
    assert cfg.top_k is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": []}, "the prompt needs at least one token"),
        ({"top_k": 0}, "top_k=0 must be > 0"),  # was every token
        ({"temperature": -1.0}, "temperature=-1.0 must be >= 0"),  # was greedy
        ({"max_new_tokens": 0}, "max_new_tokens=0 must be > 0"),
    ],
)
def test_sample_refuses_what_its_signature_declares_out_of_range(kwargs: dict, message: str) -> None:
    """The Python API's `sample` checks the ranges it declares, as `sample_batch` does (a reviewer's:
    top_k=0 sampled every token, a negative temperature decoded greedily, an empty prompt raised in
    the embedding). Mutation: sample without its check -> no ValueError."""
    kw = {"prompt_ids": PROMPT, "max_new_tokens": 4, "temperature": 1.0, "top_k": None, "max_seq_len": 128, **kwargs}
    with pytest.raises(ValueError, match=f"^sample: .*{message}"):
        sample(_model(), **kw)
