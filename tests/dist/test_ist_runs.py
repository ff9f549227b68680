"""Independent Subnet Training in real gloo ranks: against a one-process reference, its bytes, and resumed.

1. ``strategy=ist`` on 2 processes (L = 3, AdamW inner, 6 steps: two rounds) equals a reference
   written here in plain PyTorch: two model copies, each round's split drawn from (split_seed,
   round) with its own generator, each island's MLP weights and AdamW moments cut to its units by
   indexing, the two subnets trained one after the other on their islands' rows (each island's
   loss divided by its own supervised tokens), then the units written back into full tensors and
   the shared parameters averaged. Losses and parameters within 1e-6; also with ``scale_output``.
2. The bytes each rank logs: 0 inside a round; at a reassembly the shared parameters' ring
   all-reduce (2 (n - 1) / n x 4 bytes each) plus the all-gather of this island's half of the MLPs
   (weights and two moments), counted here from the model's sizes.
3. Resume: checkpointed every 2 steps with L = 4, resumed at step 2 (mid-round), 4 (a reassembly)
   and 6 (mid-round, second split): losses and parameters bitwise equal to the uninterrupted run;
   the mid-round checkpoint holds full-shape weights that load into a plain model.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import compose_config, fit, losses
from hydra.utils import instantiate

from strategies.checkpoint.dcp import load_model_weights
from trainer.build import build_data
from trainer.data.sampler import GlobalBatchSampler
from trainer.model_node import instantiate_model
from trainer.optim import build_optimizer

TOL = {"rtol": 1e-6, "atol": 1e-6}
COMMON = (
    "data.seq_len=32",
    "scheduler=constant",
    "scheduler.warmup_steps=0",
    "train.max_grad_norm=0",
    "trainer.devices=2",
    "optim=adamw",
    "strategy=ist",
    "strategy.local_sgd.split_seed=7",
    "+callbacks.params._target_=harness.ParamRecorder",
)
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
UNITS = ("w1", "w3", "w2")  # gate and up rows, down columns


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> list[str]:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "short_docs.jsonl"
    path.write_text(
        "".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))}) + "\n" for _ in range(600))
    )
    return [f"data.path={path}"]


def _run(overrides: list[str], run_dir: Path, ckpt_path: str | None = None) -> dict[str, Any]:
    _, task = fit(compose_config([*COMMON, *overrides]), run_dir, ckpt_path=ckpt_path)
    steps = [h for h in task.history if "loss" in h]
    return {
        "loss": losses(task.history),
        "steps": [h["step"] for h in steps],
        "bytes": [h.get("comm/bytes_sent", 0.0) for h in steps],
        "params": [h["params"] for h in task.history if "params" in h][-1],
    }


# ---------------------------------------------------------------------------------- the reference
def _groups(seed: int, round_index: int, ffn_dims: list[int]) -> list[list[torch.Tensor]]:
    """Round ``round_index``'s split: one permutation per MLP, in block order, halved, each half sorted."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + round_index) % 2**63)
    out = []
    for f in ffn_dims:
        perm = torch.randperm(f, generator=generator)
        out.append([perm[: f // 2].sort().values, perm[f // 2 :].sort().values])
    return out


def _cut(t: torch.Tensor, unit: str, idx: torch.Tensor) -> torch.Tensor:
    return t[:, idx].clone() if unit == "w2" else t[idx].clone()


def _paste(full: torch.Tensor, unit: str, idx: torch.Tensor, part: torch.Tensor) -> None:
    if unit == "w2":
        full[:, idx] = part
    else:
        full[idx] = part


def reference(cfg, *, steps: int, sync_every: int, seed: int, scale: bool) -> dict[str, Any]:
    """IST for two islands in one process (see the module docstring)."""
    prepared = build_data(cfg).prepare()
    torch.manual_seed(cfg.seed)
    models = [instantiate_model(cfg.model, vocab_size=prepared.tokenizer.vocab_size)]
    models.append(copy.deepcopy(models[0]))
    optimizers = [
        build_optimizer(
            m,
            instantiate(cfg.optim, _convert_="all"),
            weight_decay=cfg.optim.weight_decay,
            no_decay=tuple(cfg.train.no_decay),
        )
        for m in models
    ]
    mlps = [[block.feed_forward for block in m.layers.values()] for m in models]
    objective = instantiate(cfg.objective)
    sampler = GlobalBatchSampler(
        len(prepared.train), global_batch_size=cfg.train.global_batch_size, dp_size=1,
        shuffle=cfg.data.shuffle, seed=cfg.data.seed, drop_last=cfg.data.drop_last,
    )  # fmt: skip
    rows, out, hooks = prepared.train, {"loss": []}, []
    for step, index in zip(range(1, steps + 1), sampler):
        if step % sync_every == 1 or sync_every == 1:  # a round starts: cut each island's subnet
            groups = _groups(seed, (step - 1) // sync_every, [mlp.w1.weight.shape[0] for mlp in mlps[0]])
            for island, (island_mlps, opt) in enumerate(zip(mlps, optimizers)):
                for mlp, per_island in zip(island_mlps, groups):
                    with torch.no_grad():
                        for unit in UNITS:
                            p = getattr(mlp, unit).weight
                            for key, value in list(opt.state.get(p, {}).items()):
                                if key != "step":
                                    opt.state[p][key] = _cut(value, unit, per_island[island])
                            p.data = _cut(p.data, unit, per_island[island])
                    if scale:
                        hooks.append(mlp.register_forward_hook(lambda _m, _i, y: 2 * y))
        half = len(index) // 2
        loss_sums, counts = [], []
        for island, (model, optimizer) in enumerate(zip(models, optimizers)):  # one subnet after the other
            part = index[island * half : (island + 1) * half]
            batch = {k: getattr(rows, k)[part] for k in ("input_ids", "labels", "position_ids", "document_ids")}
            count = objective.num_tokens(batch)
            loss = objective.loss_sum(model, batch) / count
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sums.append(loss.detach() * count)
            counts.append(count)
        out["loss"].append((sum(loss_sums) / sum(counts)).item())
        if step % sync_every:
            continue
        with torch.no_grad():  # reassemble: units back in place, shared parameters averaged
            for m_index, per_island in enumerate(groups):
                for unit in UNITS:
                    narrow = [getattr(island_mlps[m_index], unit).weight for island_mlps in mlps]
                    height, width = narrow[0].shape
                    shape = (height, 2 * width) if unit == "w2" else (2 * height, width)
                    for key in ("exp_avg", "exp_avg_sq"):
                        full = torch.empty(shape)
                        for island, (p, opt) in enumerate(zip(narrow, optimizers)):
                            _paste(full, unit, per_island[island], opt.state[p][key])
                        for p, opt in zip(narrow, optimizers):
                            opt.state[p][key] = full.clone()
                    full = torch.empty(shape)
                    for island, p in enumerate(narrow):
                        _paste(full, unit, per_island[island], p.data)
                    for p in narrow:
                        p.data = full.clone()
            split = {id(getattr(mlp, u).weight) for island_mlps in mlps for mlp in island_mlps for u in UNITS}
            for p0, p1 in zip(*(m.parameters() for m in models)):
                if id(p0) not in split:
                    mean = (p0 + p1) / 2
                    p0.copy_(mean)
                    p1.copy_(mean)
        for hook in hooks:
            hook.remove()
        hooks = []
    out["params"] = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    return out


@pytest.mark.parametrize("scale", [False, True], ids=["plain", "scale_output"])
def test_ist_equals_a_one_process_reference(scale: bool, short_documents, tmp_path: Path) -> None:
    overrides = [*short_documents, "strategy.local_sgd.sync_every=3", f"strategy.local_sgd.scale_output={scale}"]
    run = _run([*overrides, "trainer.max_steps=6"], tmp_path)
    ref = reference(compose_config([*COMMON, *overrides]), steps=6, sync_every=3, seed=7, scale=scale)
    torch.testing.assert_close(run["loss"], ref["loss"], **TOL)
    torch.testing.assert_close(run["params"], ref["params"], **TOL)
    assert len(set(run["loss"])) == 6
    # Bytes per rank: the shared parameters' ring all-reduce at 2 ranks (their fp32 bytes) plus this
    # island's half of the MLPs, weights and both moments (fp32), sent to the other island.
    mlp = sum(p.numel() for n, p in run["params"].items() if n.split(".")[-2] in UNITS)
    shared = sum(p.numel() for p in run["params"].values()) - mlp
    assert mlp == 2 * 3 * 64 * 192  # nano: 2 blocks, dim 64, ffn_dim 192
    per_round = 4 * shared + 3 * 4 * mlp // 2
    assert run["bytes"] == [0.0, 0.0, per_round, 0.0, 0.0, per_round]


def test_a_run_ending_inside_a_round_ends_whole(short_documents, tmp_path: Path) -> None:
    """max_steps=4 with L=3: the second round is reassembled when training ends, so the final
    parameters, and what the last step's callbacks see (here a Hugging Face export at step 4,
    which Lightning runs before the Task's end of step), are the full model's."""
    from safetensors import safe_open

    overrides = ["strategy.local_sgd.sync_every=3", "trainer.max_steps=4", "callbacks.hf_export.every_n_steps=4"]
    run = _run([*short_documents, *overrides], tmp_path)
    assert run["params"]["layers.0.feed_forward.w1.weight"].shape == (192, 64)
    assert run["params"]["layers.0.feed_forward.w2.weight"].shape == (64, 192)
    export = tmp_path / "hf_step_0000004"
    assert json.loads((export / "config.json").read_text())["intermediate_size"] == 192
    shapes = {}
    for file in export.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (192, 64)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 192)


# ---------------------------------------------------------------------------------- resume
RESUME = ["strategy.local_sgd.sync_every=4", "trainer.max_steps=8", "callbacks.checkpoint.every_n_steps=2",
          "callbacks.checkpoint.keep_last=0"]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(short_documents, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("ist_uninterrupted")
    return run_dir / "checkpoints", _run([*short_documents, *RESUME], run_dir)


@pytest.mark.parametrize("step", [2, 4, 6], ids=["mid_round", "reassembly", "mid_second_round"])
def test_ist_resume_is_exact(step: int, short_documents, uninterrupted, tmp_path: Path) -> None:
    checkpoints, reference_run = uninterrupted
    resumed = _run([*short_documents, *RESUME], tmp_path, ckpt_path=str(checkpoints / f"step_{step:07d}"))
    assert resumed["steps"] == reference_run["steps"] == list(range(1, 9))
    assert resumed["loss"] == reference_run["loss"]
    assert resumed["bytes"][step:] == reference_run["bytes"][step:]
    for name, value in reference_run["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_a_mid_round_checkpoint_loads_into_a_plain_model(short_documents, uninterrupted) -> None:
    checkpoints, run = uninterrupted
    cfg = compose_config([*COMMON, *short_documents, *RESUME])
    model = instantiate_model(cfg.model, vocab_size=run["params"]["tok_embeddings.weight"].shape[0])
    load_model_weights(checkpoints / "step_0000002", model)  # island 0's full-shape weights
    assert model.layers["0"].feed_forward.w1.weight.shape == run["params"]["layers.0.feed_forward.w1.weight"].shape
