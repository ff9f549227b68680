"""A user's own SFT file replaces the bundled sources with one override, and its malformed row is
one ``plait: error:`` naming the file, the line and the fix: exit 2, before any process group,
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

from harness import CLI_TINY, plait

SFT_TINY = tuple(a for a in CLI_TINY if not a.startswith("data.eval_rows"))


def test_malformed_row_of_a_replacing_source_is_a_clean_error(tmp_path: Path) -> None:
    rows = [{"prompt": "hi", "completion": "yo"}, {"question": "hi", "answer": "yo"}]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = plait(
        "sft", *SFT_TINY, "data.sources={mine: {source: mine.jsonl}}", f"run_dir={tmp_path / 'run'}", cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr[-3000:]
    mine = tmp_path.resolve() / "mine.jsonl"  # made absolute where typed (trainer.data.config_paths.absolute_paths)
    assert f"plait: error: data.sources.mine: {mine}, line 2: has fields ['answer', 'question']" in result.stderr
    assert "'prompt' and 'completion'" in result.stderr and "Traceback" not in result.stderr
    assert "alpaca" not in result.stderr and "Initializing distributed" not in result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.jsonl"]
