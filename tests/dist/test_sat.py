"""Sparsity-accelerated training (`strategies.transforms.sat`): dense at rate 0, and at rate 0.5 (constant, or
the ladder schedule) one process and FSDP on 2 ranks equal an independent reference that zeroes the
omitted channels; the ladder's rates match a hand-written schedule, its dense last phase is exactly
dense training, and a run resumed across its rungs is exact.

fp32 nano Llama, the bundled corpus, global batch 8 of 64-token rows, 3 steps of SGD with momentum
(constant LR, no clipping). plait gathers the kept rows of w1/w3 and columns of w2 and runs smaller
matmuls; the reference loop written here keeps the dense matmuls and multiplies the MLP's hidden
activation by a 0/1 channel mask, so the omitted channels contribute nothing and get zero gradient
through autograd. The kept channels come from plait's `kept_channels` (the random draw is shared on
purpose: the reference checks the omission and its gradient, not the random numbers).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from harness import EXACT_SGD, MOE_SMALL, compose_config, fit, losses, reference_setup
from strategies.transforms.sat import SAT, kept_channels
from trainer.data.packing import IGNORE_INDEX

STEPS = 3
RATE = 0.5
TOL = {"rtol": 1e-5, "atol": 1e-6}
COMMON = (*EXACT_SGD, f"trainer.max_steps={STEPS}", "+callbacks.params._target_=harness.ParamRecorder")
SAT_ON = ("+strategy/sat=default", "strategy.sat.seed=5")
CONSTANT = (*SAT_ON, f"strategy.sat.rate={RATE}", "strategy.sat.ladder=null")
# The preset's ladder over 4 steps, written out: rate x [1, 1, 0.5, 0] (phases start at 0, 2, 3).
LADDER_4 = [RATE, RATE, RATE / 2, 0.0]


def _run(overrides: list[str], run_dir, ckpt_path: str | None = None) -> dict:
    _, task = fit(compose_config([*COMMON, *overrides]), run_dir, ckpt_path=ckpt_path)
    return {
        "loss": losses(task.history),
        "steps": [h["step"] for h in task.history if "loss" in h],
        "params": [h["params"] for h in task.history if "params" in h][-1],
    }


def _masked_forward(ff: torch.nn.Module, mask_f: list[torch.Tensor]):
    def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_btd)) * self.w3(x_btd) * mask_f[0])

    return types.MethodType(forward, ff)


def reference(rates: list[float]) -> dict:
    """The masked-MLP loop: step ``i`` omits ``rates[i]`` of each MLP's channels (0: none)."""
    cfg = compose_config([*COMMON, *SAT_ON])
    rows, model, optimizer, sampler = reference_setup(cfg)
    masks = {}
    for i, block in model.layers.items():
        masks[i] = [torch.ones(block.feed_forward.ffn_dim)]
        block.feed_forward.forward = _masked_forward(block.feed_forward, masks[i])
    out = {"loss": []}
    for step, index in zip(range(len(rates)), sampler):
        for i, block in model.layers.items():
            ffn_dim = block.feed_forward.ffn_dim
            if rates[step] == 0.0:
                masks[i][0] = torch.ones(ffn_dim)
                continue
            kept = kept_channels(ffn_dim, rates[step], seed=5, step=step, name=f"layers.{i}.feed_forward")
            masks[i][0] = torch.zeros(ffn_dim).index_fill_(0, kept, 1.0)
        labels = rows.labels[index]
        logits = model(
            rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
        )
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        out["loss"].append(loss.item())
        optimizer.step()
    out["params"] = {n: w.detach().clone() for n, w in model.named_parameters()}
    return out


def test_rate0_trains_exactly_as_dense(tmp_path):
    dense = _run(["train.micro_batch_size=4"], tmp_path / "dense")
    off = _run(["train.micro_batch_size=4", *CONSTANT, "strategy.sat.rate=0.0"], tmp_path / "rate0")
    assert dense["loss"] == off["loss"]
    for name, w in dense["params"].items():
        assert torch.equal(w, off["params"][name]), name


LAYOUTS = {"one_process_ga2": ["train.micro_batch_size=4"], "fsdp2": ["strategy=fsdp", "trainer.devices=2"]}


@pytest.mark.parametrize(
    ("layout", "schedule", "rates"),
    [
        ("one_process_ga2", CONSTANT, [RATE] * STEPS),
        ("fsdp2", CONSTANT, [RATE] * STEPS),
        ("fsdp2", (*SAT_ON, "trainer.max_steps=4"), LADDER_4),
    ],
    ids=["one_process_ga2", "fsdp2", "fsdp2_ladder"],
)
def test_sat_equals_reference(tmp_path, layout, schedule, rates):
    expected = reference(rates)
    run = _run([*LAYOUTS[layout], *schedule], tmp_path)
    torch.testing.assert_close(run["loss"], expected["loss"], **TOL)
    torch.testing.assert_close(run["params"], expected["params"], **TOL)


def test_ladder_rates_match_a_hand_written_schedule():
    """Phases start at ``fraction x total_steps``: 8 steps -> 0, 4, 6; 10 steps -> 0, 5, 7.5."""
    ladder = [[0.0, 1.0], [0.5, 0.5], [0.75, 0.0]]
    assert [SAT(0.4, ladder=ladder, total_steps=8).rate_at(s) for s in range(8)] == [0.4] * 4 + [0.2] * 2 + [0.0] * 2
    assert [SAT(0.4, ladder=ladder, total_steps=10).rate_at(s) for s in range(10)] == [0.4] * 5 + [0.2] * 3 + [0.0] * 2
    assert [SAT(0.3, ladder=None).rate_at(s) for s in (0, 7, 10**6)] == [0.3] * 3
    with pytest.raises(ValueError, match="must begin at 0.0"):
        SAT(0.4, ladder=[[0.5, 1.0]], total_steps=8)
    with pytest.raises(ValueError, match="total_steps > 0"):
        SAT(0.4, ladder=ladder, total_steps=-1)


# The preset's ladder over 8 steps: rate 0.5 for steps 0-3, 0.25 for 4-5, dense for 6-7.
RESUME = (*SAT_ON, "trainer.max_steps=8", "callbacks.checkpoint.every_n_steps=2", "callbacks.checkpoint.keep_last=0")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    return run_dir / "checkpoints", _run(list(RESUME), run_dir)


def test_resume_across_the_ladder_is_exact(uninterrupted, tmp_path):
    """Resumed after step 2, the run crosses both rungs (steps 4 and 6) as the uninterrupted one did."""
    checkpoints, reference_run = uninterrupted
    resumed = _run(list(RESUME), tmp_path, ckpt_path=str(checkpoints / "step_0000002"))
    assert resumed["steps"] == reference_run["steps"] == list(range(1, 9))
    assert resumed["loss"] == reference_run["loss"]
    for name, w in reference_run["params"].items():
        assert torch.equal(resumed["params"][name], w), name


def test_ladder_ends_in_exactly_dense_training(uninterrupted, tmp_path):
    """The ladder's last phase (steps 6-7) equals plain training from the same checkpoint, bitwise."""
    checkpoints, reference_run = uninterrupted
    dense = _run(["trainer.max_steps=8"], tmp_path, ckpt_path=str(checkpoints / "step_0000006"))
    assert dense["loss"][6:] == reference_run["loss"][6:]
    for name, w in reference_run["params"].items():
        assert torch.equal(dense["params"][name], w), name


def test_channels_are_cleared_after_the_step():
    """Evaluation between steps runs the dense MLP."""
    from trainer.models.block import FeedForward

    ff = FeedForward(8, 16)
    sat = SAT(rate=0.5)
    sat.apply(torch.nn.ModuleDict({"ff": ff}))
    with sat.step(3):
        assert ff.kept_f is not None and ff.kept_f.numel() == 8
    assert ff.kept_f is None


def test_the_ladder_spans_the_steps_the_data_allows(tmp_path):
    """An SFT run whose data ends before ``trainer.max_steps`` (here 1,000) plans fewer steps; the
    ladder (the preset's ``total_steps: null``) spans those, as the LR schedule does, so the run
    still reaches its dense last phase (with ``${trainer.max_steps}`` every step omitted ``rate``)."""
    import json

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"count to {i}"},
                        {"role": "assistant", "content": f"{i} {i + 1}"},
                    ]
                }
            )
            + "\n"
            for i in range(300)
        )
    )
    cfg = compose_config(
        [
            "model=nano", "data.seq_len=64", "train.global_batch_size=4", f"data.sources={{a: {{source: {chats}}}}}",
            "trainer.max_steps=1000", "train.eval_every=0", "callbacks.checkpoint.every_n_steps=0", *SAT_ON,
            "+callbacks.sat_rates._target_=harness.SatRates",
        ],
        recipe="sft",
        tiny=False,
    )  # fmt: skip
    _, task = fit(cfg, tmp_path / "run")
    rates = [h["sat"] for h in task.history if "sat" in h]
    steps = len(rates)
    assert 4 <= steps < 1000, steps
    # The preset's ladder over the planned steps: rate 0.5 to steps/2, 0.25 to 3 steps/4, then dense.
    expected = [0.5 if s < steps / 2 else 0.25 if s < 0.75 * steps else 0.0 for s in range(steps)]
    assert rates == list(enumerate(expected))


def test_float8_is_refused_by_validate_naming_the_fix():
    """SAT's sliced MLP calls F.linear on weight slices: with float8 the MLPs would run in high
    precision, or (FSDP's float8 all-gather) crash at the first forward."""
    from trainer.config import ConfigError, validate

    with pytest.raises(
        ConfigError, match=r"strategy\.sat slices .* set strategy\.float8\.recipe=null or strategy\.sat=null"
    ):
        validate(compose_config([*SAT_ON, "strategy.float8.recipe=tensorwise"]))
    validate(compose_config([*SAT_ON, "strategy.float8.recipe=null"]))


def test_routed_experts_are_said_and_a_model_without_dense_mlps_is_refused(capsys):
    """SAT sparsifies dense MLPs and shared experts; GPT-OSS (routed experts only) passed validate and
    crashed at launch, and on moe_tiny the routed experts stayed dense without a word (a fresh reviewer)."""
    from strategies.transforms.sat import SAT
    from trainer.build import build_model
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"strategy\.sat omits .* this model has none: .* or strategy\.sat=null"):
        validate(compose_config([*SAT_ON, "model=gpt_oss_tiny"]))
    cfg = compose_config([*SAT_ON, *MOE_SMALL])  # every block routed, one shared expert each: sparsified
    model = build_model(cfg, validate(cfg), vocab_size=64)
    SAT(rate=0.5).apply(model)
    assert capsys.readouterr().err.strip() == (
        "plait: warning: strategy.sat sparsifies the 2 dense MLP(s) only (shared experts included); the routed "
        "experts of the 2 mixture-of-experts block(s) stay dense"
    )


def test_a_pipeline_stage_of_routed_experts_trains_dense(tmp_path, capfd):
    """moe_tiny without shared experts on 2 pipeline stages: stage 1 holds only routed-expert blocks.
    SAT found no MLP there and raised at launch (a fresh reviewer); the stage now trains dense, said."""
    cfg = compose_config(
        [
            *SAT_ON,
            "model=moe_tiny",
            "model.num_shared_experts=0",
            "strategy=pp",
            "trainer.devices=2",
            "trainer.max_steps=1",
        ]
    )
    _, task = fit(cfg, tmp_path)
    assert len(losses(task.history)) == 1
    assert "pipeline stage 1 holds no dense MLP (routed experts only); its blocks train dense" in capfd.readouterr().err
