"""``plait compare`` names the runs that have no validation loss instead of counting them as drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.compare import main


def _run(path: Path, rows: str) -> None:
    path.mkdir(parents=True)
    (path / "metrics.csv").write_text("step,train/loss,val/loss\n" + rows)


def test_a_crashed_run_is_named_not_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "ok", "0,,8.3\n1,8.2,\n2,8.1,8.0\n")
    _run(tmp_path / "crashed", "1,8.2,\n")  # died before its first evaluation after step 0
    main([str(tmp_path), f"out={tmp_path / 'c.png'}"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"plait: wrote {tmp_path / 'c.png'} (validation loss of 1 run; no validation loss in crashed)"
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_measure_columns_appear_only_when_a_run_has_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    _run(tmp_path / "old", "0,,8.3\n2,8.1,8.0\n")  # a summary.json written before the measures existed
    (tmp_path / "old" / "summary.json").write_text(json.dumps({"steps": 2, "final_val_loss": 8.0}))
    main([str(tmp_path / "old"), f"out={tmp_path / 'c.png'}"])
    assert capsys.readouterr().out.splitlines()[0].split() == [
        "run",
        "steps",
        "val",
        "loss",
        "train",
        "loss",
        "tokens/s",
    ]
    _run(tmp_path / "dpo", "0,,0.69\n2,0.6,0.5\n")
    measures = {"val/rewards/accuracy": 0.875, "val/rewards/margin": 1.25}
    (tmp_path / "dpo" / "summary.json").write_text(
        json.dumps({"steps": 2, "stopped_by": "max_steps", "final_val_metrics": measures})
    )
    main([str(tmp_path / "old"), str(tmp_path / "dpo"), f"out={tmp_path / 'c.png'}"])
    header, _, old, dpo = capsys.readouterr().out.splitlines()[:4]
    assert (
        header.split()[-2:] == ["rewards/accuracy", "rewards/margin"] and "stopped" not in header
    )  # none stopped early
    assert old.split()[-2:] == ["-", "-"] and dpo.split()[-2:] == ["0.875", "1.25"]


def test_a_lora_run_beside_a_full_one_reads_on_and_null(tmp_path: Path) -> None:
    """A run without LoRA records strategy.lora: null, a LoRA run its fields: the strategy.lora
    column read '-' in both rows (a new user's walkthrough); a field set to null reads null, one a
    run lacks '-'."""
    from omegaconf import OmegaConf

    from trainer.compare import table

    for name, lora, epochs in (("full", None, None), ("lora", {"rank": 8}, 2)):
        _run(tmp_path / name, "0,,8.3\n")
        OmegaConf.save({"strategy": {"lora": lora}, "data": {"max_epochs": epochs}}, tmp_path / name / "config.yaml")
    header, _, full, lora = (line.split() for line in table([tmp_path / "full", tmp_path / "lora"]).splitlines())
    columns = ["data.max_epochs", "strategy.lora", "strategy.lora.rank"]
    assert header[1:4] == columns
    assert full[1:4] == ["null", "null", "-"] and lora[1:4] == ["2", "on", "8"]
