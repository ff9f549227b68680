"""strategy=ft (`strategies.fault_tolerance`): what validate accepts and refuses, and the errors that name the fix.

The numerics (two groups == one process == HSDP, the kill trial) are in tests/dist/test_replica_groups.py.
"""

from __future__ import annotations

import pytest
from harness import MOE_SMALL, compose_config

from strategies.fault_tolerance import ReplicaGroups
from trainer.compose import compose
from trainer.config import ConfigError, validate

FT = "strategies.fault_tolerance.ReplicaGroups"


@pytest.mark.parametrize("preset", ["ft", "ft_diloco"])
def test_replica_groups_with_fsdp_inside_each_group_validate(preset: str) -> None:
    run = validate(compose_config([f"strategy={preset}", "trainer.devices=2"]))
    assert (run.dims.dp_replicate, run.dims.dp_shard) == (1, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.dp_replicate=2", "trainer.devices=2", "strategy.dp_shard=1"], "use strategy.dp_replicate=1"),
        (["strategy.tp=2", "trainer.devices=2"], "use strategy.tp=1"),
        (["strategy.pp=2", "trainer.devices=2"], "use strategy.pp=1"),
        ([*MOE_SMALL], "use a dense model"),
        (
            ["strategy=desloc", "strategy.dp_replicate=1", "strategy.fault_tolerance={_target_:" + FT + "}"],
            "use strategy=ft_diloco",
        ),
        (["strategy=ft_diloco", "strategy.local_sgd.num_fragments=2"], "use strategy.local_sgd.num_fragments=1"),
    ],
    ids=["dp_replicate", "tp", "pp", "moe", "desloc", "streaming_diloco"],
)
def test_layouts_not_built_yet_are_refused_naming_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate(compose_config(overrides if overrides[0].startswith("strategy=") else ["strategy=ft", *overrides]))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"replica_group": 2}, "replica_group=2 is not one of 0..1"),
        ({"num_replica_groups": 0}, "must be at least 1"),
    ],
)
def test_bad_settings_name_the_key(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaGroups(**settings)


def test_joining_without_a_lighthouse_names_the_launcher(monkeypatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(RuntimeError, match="plait's launcher sets both"):
        ReplicaGroups(replica_group=0).join(trainer=None)


def test_each_group_trains_its_own_share_of_the_batch() -> None:
    assert ReplicaGroups(num_replica_groups=3, replica_group=2).data_share() == (2, 3)


def test_resuming_every_group_is_refused_naming_what_runs(tmp_path) -> None:
    from trainer.run import check_launch

    cfg = compose_config(["strategy=ft", "resume=last", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError) as error:
        check_launch(cfg, tmp_path)
    assert "restarting every replica group from its checkpoints is not built yet" in str(error.value)
    assert "<run_dir>/group<g>" in str(error.value)


def test_a_batch_the_groups_cannot_share_is_refused_naming_a_size() -> None:
    with pytest.raises(ConfigError) as error:
        validate(
            compose_config(
                ["strategy=ft", "trainer.devices=2", "train.global_batch_size=12", "train.micro_batch_size=2"]
            )
        )
    assert "x strategy.fault_tolerance.num_replica_groups=2 (each group trains its share of every batch)" in str(
        error.value
    )
    assert "e.g. train.global_batch_size=16" in str(error.value)


def test_preference_recipes_are_refused() -> None:
    with pytest.raises(ConfigError, match="train the preference recipes without strategy.fault_tolerance"):
        validate(compose("preference", ["model=nano", "strategy=ft"]))


def test_a_group_resumed_on_its_own_is_refused_too(tmp_path) -> None:
    from trainer.run import check_launch

    cfg = compose_config(
        ["strategy=ft", "strategy.fault_tolerance.replica_group=0", "resume=last", f"run_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match="restarting every replica group from its checkpoints is not built yet"):
        check_launch(cfg, tmp_path)


@pytest.mark.parametrize(("visible", "ok"), [(4, True), (3, False)])
def test_the_launcher_needs_gpus_for_every_group(visible: int, ok: bool) -> None:
    from trainer.replica_groups import gpu_problems

    cfg = compose_config(["strategy=ft", "trainer.devices=2", "trainer.accelerator=gpu"])
    problems = gpu_problems(cfg, visible)
    assert (problems == []) == ok
    if not ok:
        assert "needs 4 GPUs, 3 are visible; use trainer.devices=1 or fewer groups" in problems[0]


def test_a_rollback_policy_is_refused_with_replica_groups(tmp_path) -> None:
    from trainer.run import check_launch

    cfg = compose_config(["strategy=ft", "train.nonfinite=rollback", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="use train.nonfinite=skip or stop"):
        check_launch(cfg, tmp_path)
