"""strategy.cpu_allocator=keep_freed: on CPU a step's large tensors come from glibc's heap and stay there.

The setting is process-wide and permanent, so each check runs in a process of its own: a fresh
interpreter, or the forked rank of a fit. It reads glibc's own accounting, ``mallinfo2()``:
``hblkhd`` counts the bytes of live blocks that have a mapping of their own, ``keepcost`` the free
bytes at the top of the heap (those a trim would give back to the kernel).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from harness import env_with_tests
from malloc_probe import probe

from strategies.runtime.host_allocator import is_glibc

pytestmark = pytest.mark.skipif(not is_glibc(), reason="mallopt and mallinfo2 are glibc's")

ROOT = Path(__file__).resolve().parents[2]


class MallocProbe(L.Callback):
    """Appends ``{"malloc": probe()}`` to the Task's history in the training process, at train start."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.history.append({"malloc": probe()})


def _fresh_probe(setup: str) -> dict[str, float]:
    code = f"import json, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n{setup}\n"
    # malloc_probe imports torch alone: this module's imports (Lightning, plait) took 5 of the 6 s.
    code += "import malloc_probe\nprint('PROBE ' + json.dumps(malloc_probe.probe()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_with_tests(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))[6:])


def test_keep_freed_host_memory_keeps_large_blocks_in_the_heap() -> None:
    # glibc's default, the premise: a 64 MiB block gets a mapping of its own, unmapped at free.
    assert _fresh_probe("")["mapped_mib"] >= 64
    kept = _fresh_probe(
        "from strategies.runtime.host_allocator import keep_freed_host_memory\nassert keep_freed_host_memory()"
    )
    assert kept["mapped_mib"] == 0  # from the heap ...
    assert kept["kept_mib"] >= 128  # ... and still there after it is freed (not trimmed), for the next step


@pytest.mark.parametrize(("allocator", "mapped"), [(None, False), ("system", True)])
def test_a_cpu_fit_keeps_freed_blocks_unless_told_otherwise(
    tmp_path: Path, allocator: str | None, mapped: bool
) -> None:
    # The default of every strategy preset (conf/strategy/nd.yaml), applied by setup_environment in
    # the process that trains; strategy.cpu_allocator=system leaves glibc's defaults.
    overrides = [
        "trainer.max_steps=1",
        "~callbacks.checkpoint",
        "+callbacks.malloc._target_=test_host_allocator.MallocProbe",
    ]
    if allocator is not None:
        overrides.append(f"strategy.cpu_allocator={allocator}")
    # From a fresh interpreter: a forked rank inherits what mallopt an earlier fit set in the pytest
    # process (a learning-tier entry of one device trains in it), which system does not undo.
    code = (
        f"import json, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nfrom pathlib import Path\n"
        f"from harness import compose_config, fit\n_, task = fit(compose_config({overrides!r}), Path({str(tmp_path)!r}))\n"
        "print('PROBE ' + json.dumps([h['malloc'] for h in task.history if 'malloc' in h]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_with_tests(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert (record["mapped_mib"] >= 64) is mapped, record
