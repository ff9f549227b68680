"""plait's models in EleutherAI's lm-evaluation-harness (``lm_eval``, pinned in pyproject.toml).

`evaluate_tasks` runs tasks through ``lm_eval.simple_evaluate`` with a `trainer.evaluators.plait_lm.PlaitLM`
(the harness's model interface over a plait model and tokenizer) and flattens the scores;
`task_manager` finds the tasks (plait's bundled ones, local task directories, lm-eval's registry).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager, get_task_dict
from lm_eval.utils import make_table

from trainer.evaluators.plait_lm import PlaitLM

BUNDLED_TASKS_DIR = Path(__file__).parent / "tasks"
"""plait's own lm-eval task directory (``lm_eval --include_path`` reads it too)."""

BUNDLED_GROUP = "plait_bundled"
"""The tasks ``plait eval`` runs when none are given: held-out text of the bundled corpus."""


class TaskNotFoundError(ValueError):
    """A task name that neither plait's bundled tasks, the include paths nor lm-eval's registry hold."""


def task_manager(tasks: Sequence[str], include_path: Sequence[str] = ()) -> TaskManager:
    """A ``TaskManager`` that knows ``tasks``: plait's bundled tasks and ``include_path`` first
    (indexed in a blink); lm-eval's registry (about 14,000 tasks, seconds to index) only when a
    task is not among them.

    Raises:
        TaskNotFoundError: a task is in none of them (the message lists plait's and the include paths').
    """
    paths = [str(BUNDLED_TASKS_DIR), *(str(Path(p).expanduser()) for p in include_path)]
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(t in local.all_tasks for t in tasks):
        return local
    every = TaskManager(include_path=paths)
    missing = [t for t in tasks if t not in every.all_tasks]
    if missing:
        raise TaskNotFoundError(
            f"unknown lm-eval task(s) {', '.join(missing)}; plait's and the include paths' tasks: "
            f"{', '.join(local.all_tasks)} (lm-eval's own: python -m lm_eval ls tasks); a task of your own: "
            "include_path=<directory of task yaml files>"
        )
    return every


def load_tasks(tasks: Sequence[str], include_path: Sequence[str] = ()) -> TaskManager:
    """`task_manager`, then every task built once (its documents read: from the Hugging Face cache
    for lm-eval's registry, offline), so a task that cannot run fails before a model loads.

    Raises:
        TaskNotFoundError: an unknown task, or one whose data cannot be read (the message names the task
            and the cause).
    """
    manager = task_manager(tasks, include_path)
    try:
        with _rng_kept():
            get_task_dict(list(tasks), manager)
    except Exception as err:  # noqa: BLE001 - whatever stops a task's data (offline hub, missing file) ends here
        raise TaskNotFoundError(
            f"lm-eval could not build tasks {', '.join(tasks)}: {type(err).__name__}: {str(err)[:300]}; a registry "
            "task needs its dataset in the Hugging Face cache (nothing is downloaded), a task file of your own "
            "needs its data_files"
        ) from err
    return manager


def lm_eval_table(results: dict[str, Any]) -> str:
    """lm-eval's own tables of ``results`` (tasks, then groups when there are any)."""
    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)


class _DropNotices(logging.Filter):
    """lm-eval's notices about its own task options (a ``custom_dataset`` takes ``--metadata``):
    nothing a plait user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


@contextmanager
def _rng_kept() -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's global generators: a training run's draws after
    an evaluation must not depend on it, so their states come back afterwards. Its INFO records
    and notices are held back meanwhile (its warnings still show)."""
    py, np_state = random.getstate(), numpy.random.get_state()
    task_logger, notices = logging.getLogger("lm_eval.api.task"), _DropNotices()
    task_logger.addFilter(notices)
    root, level = logging.getLogger("lm_eval"), logging.getLogger("lm_eval").level
    root.setLevel(max(level, logging.WARNING))  # its INFO lines (seeds, tasks, stages) would fill a training log
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            numpy.random.set_state(np_state)
            task_logger.removeFilter(notices)
            root.setLevel(level)


def evaluate_tasks(
    lm: PlaitLM,
    tasks: Sequence[str],
    *,
    include_path: Sequence[str] = (),
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
    seed: int = 0,
    manager: TaskManager | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Runs ``tasks`` on ``lm``: (flat scores ``{"<task>/<metric>": value}`` without the
    standard errors, lm-eval's whole results dict); ``({}, {})`` on a process whose ``LOCAL_RANK``
    is not 0, where lm-eval answers its requests but reports nothing.

    Args:
        limit: at most this many documents per task (a fraction: that share), None: all.
        num_fewshot: examples in each prompt (None: each task's own default).
        apply_chat_template: render prompts with the run's chat template.
        seed: lm-eval's seeds (few-shot sampling, its Python/NumPy/torch generators).
        manager: the tasks' `task_manager` when the caller has it already.

    Raises:
        TaskNotFoundError: see `task_manager`.
    """
    with _rng_kept():
        results = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager or task_manager(tasks, include_path),
            limit=limit,
            num_fewshot=num_fewshot,
            apply_chat_template=apply_chat_template,
            bootstrap_iters=0,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    if results is None:  # lm-eval reports on the first rank of each node only (LOCAL_RANK 0)
        return {}, {}
    scores = {}
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            metric, _, kept = name.partition(",")  # lm-eval's "<metric>,<filter>"
            if isinstance(value, (int, float)) and not metric.endswith("_stderr") and metric != "sample_len":
                scores[f"{task}/{metric}" if kept in ("", "none") else f"{task}/{metric}/{kept}"] = float(value)
    return scores, results
