"""The planner plans the run the command line asks for: the settings its search does not vary
(sequence and loss parallelism, FSDP's resharding after forward) are the command line's, in every
searched layout, in its prediction and in the overrides it prints."""

from __future__ import annotations

from strategies.planner.memory import GiB
from strategies.planner.search import SearchSpace, search
from trainer.compose import compose
from trainer.config import ConfigError, validate
from trainer.planning import check_memory, cluster_from_config, plan, planner_inputs

LLAMA3_8B_8K = ["model=llama3_8b", "cluster=h100x8", "data.seq_len=8192", "train.global_batch_size=16"]
OFF = [
    "strategy.tensor_parallel.sequence_parallel=false",
    "strategy.tensor_parallel.loss_parallel=false",
    "strategy.fsdp.reshard_after_forward=false",
]


def test_the_search_keeps_and_prints_the_command_lines_unsearched_settings() -> None:
    """Before: every searched layout had sequence and loss parallelism on and resharded after
    forward, and its overrides left them out, so a command line that turned them off was ranked
    (and printed) as another run."""
    cfg = compose("pretrain", [*LLAMA3_8B_8K, *OFF])
    shape, configured, work = planner_inputs(cfg, validate(cfg, for_launch=False))
    plans = search(shape, work, cluster_from_config(cfg), SearchSpace(max_micro_batch=1), kept=configured)
    assert plans and all(
        not (p.layout.sequence_parallel or p.layout.loss_parallel or p.layout.reshard_after_forward) for p in plans
    )
    with_tp = next(p for p in plans if p.fits and p.layout.tp > 1)
    sharded = next(p for p in plans if p.fits and p.layout.fsdp_shards > 1)
    for p in (with_tp, sharded):  # the command line with the printed overrides runs the predicted layout
        again = compose("pretrain", [*LLAMA3_8B_8K, *OFF, *p.layout.overrides(trainer_devices=8)])
        assert planner_inputs(again, validate(again, for_launch=False))[1] == p.layout
    assert set(OFF[:2]) <= set(with_tp.layout.overrides()) and OFF[2] in sharded.layout.overrides()


def test_blocks_kept_gathered_after_forward_are_counted() -> None:
    """``strategy.fsdp.reshard_after_forward=false`` keeps all 32 blocks of Llama 3 8B gathered (bf16)
    where the default holds two: 30 more blocks of 218,112,000 parameters (attention 4096 x (4096 +
    2 x 1024 + 4096), SwiGLU 3 x 4096 x 14336, two norms), 12.19 GiB. Before: the same prediction."""
    run = [*LLAMA3_8B_8K, "strategy=fsdp", "trainer.devices=8", "trainer.precision=bf16-mixed", "planner.check=true",
           "strategy.fsdp.param_dtype=bf16"]  # fmt: skip
    block = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
    predicted = {}
    for reshard in ("true", "false"):
        cfg = compose("pretrain", [*run, f"strategy.fsdp.reshard_after_forward={reshard}"])
        try:
            check_memory(cfg, validate(cfg, for_launch=False))
        except ConfigError as err:  # over the 77 GiB of an H100 either way (activations of 2 rows of 8k)
            predicted[reshard] = float(err.problems[0].split("need ")[1].split(" GiB")[0])
    assert abs(predicted["false"] - predicted["true"] - 30 * block * 2 / GiB) < 0.01, predicted


# Float8 tensorwise is refused with context and tensor parallelism (`strategies.float8.Float8.problems`);
# the search space is cut down to keep the test fast.
FLOAT8 = [
    *LLAMA3_8B_8K,
    *("trainer.precision=bf16-mixed", "strategy.float8.recipe=tensorwise", "planner.ac_modes=[full]"),
    *("planner.max_micro_batch=1", "planner.hsdp=false", "planner.top=3"),
]


def _overrides(out: str) -> list[str]:
    return out.split("\noverrides: ")[1].split("\n")[0].split()


def test_every_layout_the_plan_shows_is_one_validate_accepts() -> None:
    """Before: the best line was dp_shard4 cp2 ring, which validate refuses (tensorwise float8 under
    context parallelism), so the plan's command failed at launch."""
    cfg = compose("pretrain", FLOAT8)
    out = plan(cfg, validate(cfg, for_launch=False))
    assert "faster layouts left out: validate refuses them" in out and "with context parallelism" in out, out
    rows = [line.split()[1:4] for line in out.splitlines() if line[:5].strip().isdigit()]
    assert len(rows) == 3 and not any(w.startswith(("cp", "tp")) for row in rows for w in row), rows
    validate(compose("pretrain", [*FLOAT8, *_overrides(out)]), for_launch=False)  # the best line is accepted


def test_the_overrides_undo_what_the_command_line_set_and_the_layout_does_not_use() -> None:
    """Before: a layout without activation checkpointing printed no ``mode``, so added to a command
    line with ``mode=full`` it ran full checkpointing, not the layout planned."""
    command = [*LLAMA3_8B_8K, "strategy.activation_checkpoint.mode=full", "planner.ac_modes=[none]"]
    cfg = compose("pretrain", [*command, "planner.max_micro_batch=1", "planner.top=1"])
    out = plan(cfg, validate(cfg, for_launch=False))
    assert "strategy.activation_checkpoint.mode=none" in _overrides(out), out
    again = compose("pretrain", [*command, *_overrides(out)])
    assert planner_inputs(again, validate(again, for_launch=False))[1].ac == "none"


def test_fsdp_cpu_offload_keeps_the_shards_off_the_device() -> None:
    """strategy.fsdp.cpu_offload=true was ignored: planner.check refused an 8B fsdp8 run at 83.63
    GiB that the offload of 14.96 GiB of shards was chosen to fit (a reviewer's)."""
    from strategies.planner.memory import predict_memory

    run = [*LLAMA3_8B_8K, "strategy=fsdp", "trainer.devices=8", "trainer.precision=bf16-mixed",
           "strategy.fsdp.param_dtype=bf16", "train.micro_batch_size=1"]  # fmt: skip
    predicted = {}
    for offload in ("false", "true"):
        cfg = compose("pretrain", [*run, f"strategy.fsdp.cpu_offload={offload}"])
        shape, layout, work = planner_inputs(cfg, validate(cfg, for_launch=False))
        assert layout.fsdp_cpu_offload == (offload == "true")
        assert ("strategy.fsdp.cpu_offload=true" in layout.overrides()) == (offload == "true")
        predicted[offload] = predict_memory(shape, layout, work)
    on, off = predicted["true"], predicted["false"]
    assert (on.params, on.grads, on.optimizer) == (0, 0, 0) and off.params > 0
    assert off.total - on.total == off.params + off.grads + off.optimizer
    # A searched layout without FSDP offloads nothing: its overrides undo the command line's offload,
    # which validate refuses there (a reviewer's tp4 pp2 row).
    command = [*run, "strategy.fsdp.cpu_offload=true", "planner.max_micro_batch=1", "planner.hsdp=false"]
    cfg = compose("pretrain", command)
    shape, configured, work = planner_inputs(cfg, validate(cfg, for_launch=False))
    plans = search(shape, work, cluster_from_config(cfg), SearchSpace(max_micro_batch=1), kept=configured)
    plain = next(p for p in plans if not p.layout.uses_fsdp)
    overrides = plain.layout.overrides(trainer_devices=8, against=configured)
    assert "strategy.fsdp.cpu_offload=false" in overrides
    validate(compose("pretrain", [*command, *overrides]), for_launch=False)


def test_a_searched_pipeline_layout_undoes_the_command_lines_split_points() -> None:
    """The printed overrides kept the command line's strategy.pipeline.split_points=[3], so the run
    that followed was not the layout predicted, and interleaved layouts were refused for it."""
    command = ["model=nano", "model.n_layers=4", "cluster=cpu", "data.seq_len=64", "trainer.devices=2", "strategy=pp",
               "strategy.pipeline.split_points=[3]"]  # fmt: skip
    cfg = compose("pretrain", command)
    shape, configured, work = planner_inputs(cfg, validate(cfg, for_launch=False))
    assert configured.split_points == (3,)
    plans = search(shape, work, cluster_from_config(cfg), SearchSpace(max_micro_batch=1), kept=configured)
    searched = next(p for p in plans if p.layout.pp == 2 and p.layout.split_points is None)
    overrides = searched.layout.overrides(trainer_devices=2, against=configured)
    assert "strategy.pipeline.split_points=null" in overrides
    again = compose("pretrain", [*command, *overrides])
    assert planner_inputs(again, validate(again, for_launch=False))[1].split_points is None
