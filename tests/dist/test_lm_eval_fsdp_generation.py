"""The lm-eval adapter's generation under FSDP2 (as ``callbacks.lm_eval`` runs it: every rank answers
the same requests, without the KV cache, all ranks stepping together through ``all_done``) gives the
texts of one process: greedy continuations of prompts of different lengths (left-padded), stop strings."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp
from hf_checkpoints import corpus_texts
from lm_eval.api.instance import Instance

from trainer.callbacks.lm_eval import _all_ranks_done
from trainer.data.tokenizer import train_bpe
from trainer.evaluators.plait_lm import PlaitLM
from trainer.models.llama import Llama

PROMPTS = ["thou art", "the king is dead, long live the", "and God said", "to be or not"]


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64).eval()
    with torch.no_grad():  # larger weights than the init: greedy paths that vary with the prompt
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(std=0.2)
    return model


def _requests() -> list[Instance]:
    return [
        Instance("generate_until", {}, (p, {"until": ["zz"], "max_gen_toks": 12 if i % 2 else 7}), i)
        for i, p in enumerate(PROMPTS)
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        model = _model()
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        device = torch.device("cpu")
        tokenizer = train_bpe(corpus_texts(), vocab_size=300)
        lm = PlaitLM(model, tokenizer, batch_size=3, all_done=_all_ranks_done(device), kv_cache=False)
        torch.save(lm.generate_until(_requests()), f"{out_dir}/rank{rank}.pt")
    except Exception:  # reported to the test rather than lost in a child process
        torch.save(traceback.format_exc(), f"{out_dir}/rank{rank}.pt")
    finally:
        os._exit(0)  # results are on disk: skip gloo's teardown (it sometimes aborts)


def test_fsdp_generation_gives_the_texts_of_one_process(tmp_path) -> None:
    expected = PlaitLM(_model(), train_bpe(corpus_texts(), vocab_size=300), batch_size=3).generate_until(_requests())
    ctx, port = mp.get_context("fork"), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert not isinstance(got, str), f"rank {rank} failed:\n{got}"
        assert got == expected, rank
    assert len(set(expected)) == len(PROMPTS)  # four different continuations: the check can tell them apart
