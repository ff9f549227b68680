"""A user's code in the current folder: importable by plait without PYTHONPATH, and a file there
named like one of plait's packages (trainer.py) does not shadow it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _plait(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # The console script, as a user runs it (``python -m`` would put the folder first on the path itself).
    script = Path(sys.executable).with_name("plait")
    return subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_user_code_in_the_current_folder_imports_and_shadows_nothing(tmp_path: Path) -> None:
    (tmp_path / "trainer.py").write_text('raise SystemExit("the user\'s trainer.py was imported")\n')
    (tmp_path / "strategies.py").write_text('raise SystemExit("the user\'s strategies.py was imported")\n')
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "opt.py").write_text("import torch\n\nclass MyAdam(torch.optim.AdamW):\n    pass\n")
    help_ = _plait("--help", cwd=tmp_path)
    assert help_.returncode == 0 and "Commands" in help_.stdout, help_.stdout + help_.stderr
    # validate imports the user's optimizer class (else: "cannot be imported"); the one problem left is
    # the deliberate bad value, so nothing trains and nothing is written.
    bad = _plait("pretrain", "optim._target_=my_pkg.opt.MyAdam", "trainer.max_steps=abc", cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    problems = [line for line in bad.stderr.splitlines() if line.startswith("  - ")]
    assert problems == ["  - trainer.max_steps='abc' must be int"], bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_pkg", "strategies.py", "trainer.py"]
