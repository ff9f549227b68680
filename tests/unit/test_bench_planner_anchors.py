"""bench/planner_anchors.py runs (it had stopped at an import of a removed ModelShape.from_config
with every test green) and keeps its published-throughput result within what docs/benchmarks.md says."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "planner_anchors.py"


def test_the_planner_anchors_bench_runs_and_prints_its_result(capsys) -> None:
    spec = importlib.util.spec_from_file_location("planner_anchors", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    result = re.search(r"RESULT max_abs_err=([\d.]+) within_25pct=(\d+)/(\d+)", capsys.readouterr().out)
    assert result is not None
    assert float(result[1]) < 0.5 and int(result[2]) >= 7, result[0]
