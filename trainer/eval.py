"""``plait eval ckpt=...``: score a run's checkpoint (or a Hugging Face model directory) on
lm-evaluation-harness tasks; print lm-eval's table and write the scores to ``<run>/eval/<checkpoint>.json``
(``out=DIR``: ``DIR/<checkpoint>.json``, e.g. for a read-only Hugging Face directory).

With no ``tasks=``, the bundled tasks run (``plait_bundled``: perplexity and a next-line choice on
the held-out documents of the bundled corpus; nothing downloads). Any task of lm-eval's registry
runs too when its dataset is already in the Hugging Face cache (this command sets
``HF_DATASETS_OFFLINE=1``: nothing is fetched), and so does a task of your own: a directory of
lm-eval task files (``include_path=``) whose ``dataset_kwargs.data_files`` name local files.
The adapter is `trainer.evaluators.plait_lm.PlaitLM`. The JSON holds the checkpoint, its step,
the flat scores (``<task>/<metric>``) and lm-eval's results; evaluating the same checkpoint again
adds to (and replaces the tasks of) its file. ``plait compare`` shows the newest file's scores.

Invocation::

    plait eval ckpt=runs/pretrain
    plait eval ckpt=runs/pretrain/checkpoints/step_200 limit=20
    plait eval ckpt=runs/sft tasks=[my_task] include_path=[my_tasks] apply_chat_template=true
    plait eval ckpt=runs/pretrain/hf tasks=[hellaswag] num_fewshot=0   # hellaswag already cached
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainer.compose import compose_command, fail

EVAL_DIR = "eval"


def writable_problem(directory: Path) -> str | None:
    """Why ``directory`` (made when missing) cannot take the scores' file; None when it can."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), directory)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"{directory} cannot be written ({existing} is not a writable directory)"
    return None


def write_scores(
    eval_dir: Path,
    name: str,
    step: int | None,
    scores: dict[str, float],
    results: dict[str, Any] | None,
    settings: dict[str, Any] | None = None,
    *,
    model: str | None = None,
) -> Path:
    """Adds ``scores`` (and lm-eval's ``results``, and the ``settings`` they were scored with:
    ``limit``, ``num_fewshot``, ``max_length``, recorded per task) to ``<eval_dir>/<name>.json``
    (a run's: ``<run>/eval``), with the ``model`` scored (its checkpoint's path): its earlier tasks
    stay, the same task's scores are replaced. Written whole to a temporary file, then renamed.

    Returns:
        The file's path.
    """
    path = eval_dir / f"{name}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    tasks = {key.split("/")[0] for key in scores}
    kept = {k: v for k, v in (old.get("scores") or {}).items() if k.split("/")[0] not in tasks}
    record = {
        "checkpoint": name,
        **({"model": model} if model is not None else {}),
        "step": step,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "scores": {**kept, **scores},
        "results": {**(old.get("results") or {}), **(results or {})},
        "settings": {**(old.get("settings") or {}), **{task: dict(settings or {}) for task in sorted(tasks)}},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def scores_model(path: Path) -> str | None:
    """The model whose scores the file ``path`` holds (``write_scores``'s ``model``); None without
    a file, or a file that names none."""
    try:
        return json.loads(path.read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return None


def newest_scores(run_dir: Path) -> dict[str, float]:
    """The scores of the run's evaluation at its latest step (``plait compare``); {} without one."""
    records = []
    for path in sorted((run_dir / EVAL_DIR).glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return {}
    newest = max(records, key=lambda r: (r.get("step") if r.get("step") is not None else -1, r.get("written_at", "")))
    return dict(newest.get("scores") or {})


def main(argv: list[str]) -> None:
    """Entry of ``plait eval``: ``key=value`` arguments of conf/eval.yaml; exit 2 on bad input."""
    cfg = compose_command("eval", argv, usage="plait eval ckpt=<run, checkpoint or Hugging Face dir> [tasks=[...]]",
                          lists=("tasks", "include_path", "trust"))  # fmt: skip
    if not cfg.tasks:
        fail("tasks=[] names no task; give lm-eval task names, or leave tasks out for the bundled ones")
    if cfg.batch_size < 1 or (cfg.max_length is not None and cfg.max_length < 2):
        fail(f"batch_size={cfg.batch_size} must be >= 1 and max_length={cfg.max_length} >= 2")
    missing = [p for p in cfg.include_path if not Path(p).expanduser().is_dir()]
    if missing:
        fail(f"include_path: {', '.join(missing)} is not a directory; give directories of lm-eval task yaml files")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before `datasets` is imported: fetch nothing
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # with lm-eval below, seconds to import: plait compare (reading newest_scores) does not pay

    from trainer.data.answer_end import turn_end_ids  # tokenizers and jinja2: this command only
    from trainer.data.chat import ChatError  # jinja2: this command only
    from trainer.evaluators.lm_harness import (  # lm-eval and its dependencies: this command only
        TaskNotFoundError,
        evaluate_tasks,
        lm_eval_table,
        load_tasks,
    )
    from trainer.evaluators.plait_lm import PlaitLM  # lm-eval and its dependencies: this command only
    from trainer.export import trained_chat_template  # the model code: this command only
    from trainer.generate import chat_template, load_for_generation  # imports the model code: here only

    try:
        manager = load_tasks(list(cfg.tasks), list(cfg.include_path))  # before a large model loads
    except TaskNotFoundError as err:
        fail(str(err))
    run = load_for_generation(cfg.ckpt, cfg.trust)
    if cfg.max_length is not None and cfg.max_length > run.model.max_seq_len:
        fail(
            f"max_length={cfg.max_length} is above the model's context ({run.model.max_seq_len}); lower it or leave it out"
        )
    eval_dir = Path(cfg.out).expanduser() if cfg.out is not None else Path(run.run.path) / EVAL_DIR
    if (problem := writable_problem(eval_dir)) is not None:
        fail(f"the scores would go to {problem}; give out=<a writable directory>")
    checkpoint = Path(run.checkpoint).resolve()
    # A folder of several models' scores (out=) names each file by its run too: runs share step names.
    run_dir = Path(run.run.path).resolve()
    name = checkpoint.name if cfg.out is None or run_dir == checkpoint else f"{run_dir.name}_{checkpoint.name}"
    # out= gathers many models' files; a run's own eval/ is its own (moved or copied, it stays so).
    if cfg.out is not None and (owner := scores_model(eval_dir / f"{name}.json")) not in (None, str(checkpoint)):
        fail(f"{eval_dir / (name + '.json')} holds the scores of another model ({owner}); give another out=")
    # A run is scored in windows of the rows it trained on (a tiny model's RoPE table reaches further than its data).
    trained = OmegaConf.select(run.config, "data.seq_len", default=None) if run.config is not None else None
    max_length = cfg.max_length or min(int(trained or run.model.max_seq_len), run.model.max_seq_len)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    template = chat_template(run) if cfg.apply_chat_template else None
    try:  # generations end at the run's end of turn whether or not prompts are rendered with it (as callbacks.lm_eval)
        stop_ids = turn_end_ids(run.tokenizer, template or trained_chat_template(run))
    except ChatError:
        stop_ids = ()
    lm = PlaitLM(
        run.model.to(device),
        run.tokenizer,
        device=device,
        batch_size=cfg.batch_size,
        max_length=max_length,
        chat_template=(lambda messages, gen: template.render(messages, add_generation_prompt=gen))
        if template
        else None,
        stop_ids=stop_ids,
    )
    scores, results = evaluate_tasks(
        lm,
        list(cfg.tasks),
        limit=cfg.limit,
        num_fewshot=cfg.num_fewshot,
        apply_chat_template=cfg.apply_chat_template,
        seed=cfg.seed,
        manager=manager,
    )
    print(lm_eval_table(results))
    from trainer.checkpoint_step import name_step  # lazy: torch and DCP, loaded by now

    settings = {"limit": cfg.limit, "num_fewshot": cfg.num_fewshot, "max_length": lm.max_length}
    path = write_scores(
        eval_dir, name, name_step(checkpoint), scores, results.get("results"), settings, model=str(checkpoint)
    )
    print(f"plait: scores written to {path}", file=sys.stderr)
