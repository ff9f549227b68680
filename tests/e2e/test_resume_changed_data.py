"""A resume refuses data files that changed under the same config: the checkpoint's data position
indexes the rows it was prepared with, so a file rewritten at the same path (here: two documents
swapped) would resume on other rows, and on documents held out before. The refusal comes before
anything is written and names the fix (`trainer.resume`, `trainer.data.fingerprint`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness import CLI_TINY, plait

from trainer.data import default_corpus

RUN = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")] + [
    "trainer.max_steps=2", "callbacks.checkpoint.every_n_steps=2", "data.vocab_size=512", "data.val_fraction=0.2",
]  # fmt: skip


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def test_a_resume_on_rewritten_data_files_is_refused(tmp_path: Path) -> None:
    texts = [d.text[:3000] for d in default_corpus.load_bundled(["shakespeare"])[:12]]
    data = tmp_path / "docs"
    data.mkdir()
    for i, text in enumerate(texts):
        (data / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    run_dir = tmp_path / "run"
    _ok(plait(*RUN, f"data.path={data}", f"run_dir={run_dir}"))
    before = {p: (run_dir / p).read_bytes() for p in ("config.yaml", "tokenizer.json", "metrics.csv")}

    # The same config and tokenizer (data.tokenizer: the run's own), two documents' texts swapped.
    (data / "doc00.txt").write_text(texts[1], encoding="utf-8")
    (data / "doc01.txt").write_text(texts[0], encoding="utf-8")
    result = plait(
        *RUN, f"data.path={data}", f"data.tokenizer={run_dir / 'tokenizer.json'}", f"run_dir={run_dir}",
        "resume=last", "trainer.max_steps=4",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the training data differs from the data" in result.stderr, result.stderr[-3000:]
    assert "model.init_from=" in result.stderr
    assert {p: (run_dir / p).read_bytes() for p in before} == before  # nothing rewritten
