"""Resume consistency: a resumed run is the run its checkpoint belongs to, unless told otherwise.

Every checkpoint records the resolved config, the tokenizer fingerprint and the data fingerprint
it was trained with (`run_record`, saved in its ``meta.pt`` by `trainer.resume_record.ResumeRecord`). Before
anything is written, `resume_problems` compares them with the new run's:

- ``model.*`` and ``objective.*`` (and the tokenizer, by fingerprint) can never change: the
  weights, the loss or the token ids would no longer match;
- ``data.*``, ``seed`` and ``train.global_batch_size`` neither, nor the data itself (a file
  rewritten at the same path: `trainer.data.fingerprint`): the saved data position (global
  batches trained, `trainer.data.loader`) would index other rows (continue from these weights on
  other data with a new run and ``model.init_from=<checkpoint>``); ``train.micro_batch_size`` is
  free (it only splits the same global batch into gradient-accumulation steps);
- ``optim.*``, ``scheduler.*`` and ``train.max_grad_norm`` may change when named in
  ``resume_override=[...]``, but for the optimizer's class and Muon's ``adamw_params``, which decide
  what the saved optimizer state holds; their new values then take effect from the first resumed step
  (`trainer.resume_record.apply_overrides`: the restored optimizer state would otherwise keep the old ones);
- the layout (``strategy.*``, ``trainer.*``: world size, ``max_steps``), logging, callbacks and
  evaluation settings are free (DCP reshards; the scheduler takes the new ``max_steps``).

Every refused difference is listed with both values and the fix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from strategies.checkpoint.dcp import META_FILE
from strategies.checkpoint.safe_load import UnsafePickleError, load_plain
from trainer.config import ConfigError
from trainer.data.paths import absolute, is_path_key

SHOWN = 3  # refused differences listed before the rest are counted
RESUMES_FILE = "resumes.jsonl"  # one line per resume of a run directory: its step, checkpoint, changes
RECORD_KEY = "plait_run"  # the checkpoint dict's entry (hence meta.pt's) holding the `run_record`

# strategy.lora: the adapters' shapes, targets and scaling are what a LoRA checkpoint holds;
# strategy.local_sgd._target_: the algorithm whose islands, anchor and outer state a checkpoint of
# local SGD holds (resumed without it, island 0's weights went on and the rest was dropped).
LOCAL_SGD = "strategy.local_sgd._target_"
FIXED = ("model", "objective", "data", "seed", "train.global_batch_size", "strategy.lora", LOCAL_SGD)
DATA_POSITION = ("data", "seed", "train.global_batch_size")  # fields the saved data position depends on
OVERRIDABLE = ("optim", "scheduler", "train.max_grad_norm")
# optim fields that decide the shape of the saved optimizer state (which tensors, for which parameters):
# even named in resume_override they cannot change (the load failed, calling the checkpoint damaged).
OPTIMIZER_STATE = ("optim._target_", "optim.adamw_params")
# Keys of the fixed groups that do not change what is trained: where a file is cached, where
# the initial weights came from (the checkpoint holds them now), the tokenizer path (compared
# by the tokenizer's fingerprint instead).
IGNORED = ("data.cache_dir", "model.init_from", "data.tokenizer", "model.config_from")


def run_record(
    config: dict[str, Any],
    tokenizer_fingerprint: str,
    data_fingerprint: str | None = None,
    dp: int | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What a checkpoint records of its run (plain types: it goes into ``meta.pt``); ``data_fingerprint``
    None: the data module does not tell (`trainer.protocols.DataModule.data_fingerprint`); ``dp``: the
    data-parallel degree its batches were split over (None: not known); ``base``: the checkpoint its
    first step started from (`trainer.init_from.started_from`; None: none, or not a plait checkpoint)."""
    return {"config": config, "tokenizer": tokenizer_fingerprint, "data": data_fingerprint, "dp": dp, "base": base}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's serialised form (``tokenizers`` JSON): equal iff same token ids."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def read_record(checkpoint: Path) -> dict[str, Any] | None:
    """The `run_record` saved in ``checkpoint`` (None: a checkpoint written before plait recorded it).

    Raises:
        ConfigError: the loop state does not load safely (a weights-only load refuses it).
    """
    try:
        meta = load_plain(Path(checkpoint) / META_FILE)
    except (UnsafePickleError, OSError, RuntimeError, EOFError) as err:
        raise ConfigError(
            [f"{checkpoint}/{META_FILE} cannot be read safely ({err}); resume from another checkpoint"]
        ) from None
    return meta.get(RECORD_KEY) if isinstance(meta, dict) else None


def check_resume(
    cfg: DictConfig,
    checkpoint: Path | None,
    tokenizer: Any = None,
    data_fingerprint: str | None = None,
    dp: int | None = None,
) -> dict[str, Any]:
    """Refuses a resume that would train another run; returns the overridden values to apply.

    Runs before anything is written: in `trainer.run.check_launch` (``tokenizer`` and
    ``data_fingerprint`` None: the data is not prepared yet) and again once they are known; ``dp``
    the new run's data-parallel degree (None: not compared).

    Returns:
        ``{dotted key: new value}`` of the ``resume_override`` fields that differ from the record.

    Raises:
        ConfigError: every refused difference, each with its fix; or ``resume_override`` without
            a resume.
    """
    overrides = list(cfg.get("resume_override") or [])
    if checkpoint is None:
        if overrides:
            raise ConfigError(
                [f"resume_override={overrides} needs resume=last (or a checkpoint); drop it for a fresh start"]
            )
        return {}
    record = read_record(checkpoint)
    if record is None:
        return {}
    new = OmegaConf.to_container(cfg, resolve=True)
    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    if problems := resume_problems(
        record, new, fingerprint, overrides, source=str(checkpoint), data_fingerprint=data_fingerprint, dp=dp
    ):
        if len(problems) > SHOWN:  # another composed config (overrides not typed again), not a changed field
            run_dir = Path(checkpoint).parent.parent
            was, now = record["config"].get("recipe"), new.get("recipe")
            other = f" ({run_dir} is a {was} run, this a {now} one)" if was and now and was != now else ""
            problems = [
                f"this config differs from the one {run_dir} was trained with in {len(problems)} fields{other}; "
                f"continue the run with its own config: plait resume {run_dir} [overrides]",
                *problems[:SHOWN],
                f"... and {len(problems) - SHOWN} more",
            ]
        raise ConfigError(problems)
    return {key: now for key, (_, now) in differences(record["config"], new).items() if _under(key, overrides)}


# A resume's own settings: they differ on every resume by design.
RESUME_KEYS = ("run_dir", "resume", "resume_override")


def free_changes(saved: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, new value)}`` of the fields a resume may change freely (the
    layout, ``trainer.*`` such as ``max_steps`` and the checkpoint interval, logging, callbacks,
    evaluation) that differ from the checkpoint's run: said at launch and recorded in the run
    directory's ``resumes.jsonl`` (`ResumeRecord`)."""
    compared = (*FIXED, *OVERRIDABLE, *RESUME_KEYS)
    return _changed(saved, new, lambda k: not _under(k, compared))


def resume_changes(cfg: DictConfig, checkpoint: Path | None) -> dict[str, tuple[Any, Any]]:
    """Every field of ``cfg`` that differs from the run ``checkpoint`` recorded ({} for a fresh
    start or a checkpoint without a record): `free_changes` and the ``resume_override`` ones."""
    record = read_record(checkpoint) if checkpoint is not None else None
    if record is None:
        return {}
    new = OmegaConf.to_container(cfg, resolve=True)
    overrides = list(cfg.get("resume_override") or [])
    overridden = {k: v for k, v in differences(record["config"], new).items() if _under(k, overrides)}
    return {**free_changes(record["config"], new), **overridden}


def _flat(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def _under(key: str, roots: Sequence[str]) -> bool:
    return any(key == root or key.startswith(root + ".") for root in roots)


class _Absent:
    """A field one of two configs does not have (shown as such, not as None)."""

    def __repr__(self) -> str:
        return "(absent)"

    __str__ = __repr__


ABSENT = _Absent()


def differences(saved: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, new value)}`` of the compared fields that differ (`ABSENT` for a
    field one side lacks)."""
    roots = (*FIXED, *OVERRIDABLE)
    changed = _changed(saved, new, lambda k: _under(k, roots) and not _under(k, IGNORED))
    # A path recorded as typed (runs before paths were made absolute) names the same files as its
    # absolute form from here.
    return {k: v for k, v in changed.items() if not is_path_key(k) or absolute(v[0]) != absolute(v[1])}


def _changed(saved: dict[str, Any], new: dict[str, Any], keep: Callable[[str], bool]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved, new)}`` of the leaves ``keep`` selects whose values differ (`ABSENT`: one side lacks it)."""
    a = {k: v for k, v in _flat(saved) if keep(k)}
    b = {k: v for k, v in _flat(new) if keep(k)}
    return {
        k: (a.get(k, ABSENT), b.get(k, ABSENT))
        for k in sorted(a.keys() | b.keys())
        if a.get(k, ABSENT) != b.get(k, ABSENT)
    }


def resume_problems(
    record: dict[str, Any],
    new: dict[str, Any],
    tokenizer_fingerprint: str | None,
    overrides: Sequence[str],
    *,
    source: str,
    data_fingerprint: str | None = None,
    dp: int | None = None,
) -> list[str]:
    """Why the run ``new`` may not resume from a checkpoint recording ``record`` ([] if it may).

    Args:
        record: the checkpoint's `run_record`.
        new: the new run's resolved config (plain containers).
        tokenizer_fingerprint: the new run's tokenizer (None: not known yet, not compared).
        overrides: the ``resume_override`` keys (prefixes: ``optim`` allows every optim field).
        source: the checkpoint, for the messages.
        data_fingerprint: the new run's prepared data (None: not known yet, not compared; a record
            without one, written before plait recorded it, is not compared either).
        dp: the new run's data-parallel degree (None: not known). With ``data.drop_last=false``
            each epoch's last, partial global batch is trimmed to a multiple of dp rows
            (`trainer.data.sampler`), so the saved position only holds at the saved dp.
    """
    problems = []
    saved_data = record.get("data")  # absent in checkpoints written before it was recorded
    changed_data = data_fingerprint is not None and saved_data is not None and saved_data != data_fingerprint
    if changed_data:
        problems.append(
            f"the training data differs from the data {source} was trained on (fingerprint {saved_data[:12]} vs "
            f"{data_fingerprint[:12]}; the config is the same, so a file it reads changed): the saved data position "
            f"would index other rows, and held-out documents could be trained on; resume with the run's own data "
            f"files, or train on the new data from these weights in a new run_dir with model.init_from={source}"
        )
    problems.extend(_lora_base_problems(record["config"], new, source))
    saved_dp = record.get("dp")
    drop_last = (new.get("data") or {}).get("drop_last", True)
    if drop_last is False and dp is not None and saved_dp is not None and saved_dp != dp:
        problems.append(
            f"data.drop_last=false trims each epoch's last, partial global batch to a multiple of dp rows, and {source} "
            f"was trained at dp={saved_dp}, this layout has dp={dp}: its epochs would hold other rows from the saved "
            f"position on; resume with the saved data-parallel degree (dp_replicate x dp_shard = {saved_dp})"
        )
    trained_tokenizer = not (new.get("data") or {}).get("tokenizer")  # trained from the data files
    if tokenizer_fingerprint is not None and record["tokenizer"] != tokenizer_fingerprint:
        if changed_data and trained_tokenizer:  # a consequence of the changed files, not a second fix
            problems[0] += " (the tokenizer differs too: plait trained it again on the changed files)"
        else:
            problems.append(
                f"the tokenizer differs from the one {source} was trained with (fingerprint {record['tokenizer'][:12]} "
                f"vs {tokenizer_fingerprint[:12]}): its token ids would mean other text; use the run's own "
                f"tokenizer.json (data.tokenizer=<run>/tokenizer.json) or start a new run_dir"
            )
    bad_overrides = [k for k in overrides if not _under(k, OVERRIDABLE)]
    if bad_overrides:
        problems.append(
            f"resume_override={list(bad_overrides)}: only {', '.join(OVERRIDABLE)} fields can change on a resume"
        )
    for key, (old, now) in differences(record["config"], new).items():
        differs, back = _differs(key, old, now, source), _as_saved(key, old)
        if key == LOCAL_SGD:
            held = f"its islands ({old})" if old is not ABSENT else "no islands (local SGD off)"
            problems.append(
                f"{differs}: {source} holds {held}, and a resume keeps how the run trains; resume with the run's own "
                f"strategy (plait resume <run dir> keeps it), or start a new run_dir with model.init_from={source}"
            )
        elif key in OPTIMIZER_STATE:
            problems.append(
                f"{differs}: {source} holds the optimizer state of {_setting(key, old)} (its moments, per parameter), "
                "which the new setting cannot take; resume with the run's own optimizer (drop the optim override: "
                f"plait resume <run dir> keeps it), or start a new run_dir with model.init_from={source} (fresh "
                "optimizer state)"
            )
        elif key == "optim.weight_decay" and not old and _under(key, overrides):
            problems.append(
                f"optim.weight_decay cannot change from {old!r} on a resume: the saved parameter groups do not tell "
                f"which parameters decay; start a new run_dir with model.init_from={source}"
            )
        elif _under(key, OVERRIDABLE):
            if not _under(key, overrides):
                problems.append(
                    f"{differs}; to change it from this step on, add resume_override=[{key}] (or resume {back})"
                )
        elif _under(key, DATA_POSITION):
            problems.append(
                f"{differs}: the saved data position would index other rows; resume {back}, or train on the new "
                f"data from these weights in a new run_dir with model.init_from={source}"
            )
        else:  # a LoRA checkpoint holds adapters only: no base for model.init_from
            start = (
                "" if _under(key, ("strategy.lora",)) else f" (model.init_from={source} starts it from these weights)"
            )
            problems.append(
                f"{differs}: the checkpoint's weights and loss belong to {_setting(key, old)}; resume {back}, or "
                f"start a new run_dir{start}"
            )
    return problems


def _lora_base_problems(saved: dict[str, Any], new: dict[str, Any], source: str) -> list[str]:
    """A LoRA run's checkpoints hold only its adapters, and a resume reloads the base from
    ``model.init_from``: another base (the base run trained on since, and its directory now names a
    newer checkpoint) would carry adapters trained on other weights. [] for other runs."""
    if (saved.get("strategy") or {}).get("lora") is None:
        return []
    old, now = (saved.get("model") or {}).get("init_from"), (new.get("model") or {}).get("init_from")
    if old == now or (isinstance(old, str) and isinstance(now, str) and absolute(old) == absolute(now)):
        return []
    return [
        f"model.init_from={now!r} differs from {old!r} in {source}: its LoRA adapters were trained on that base, and a "
        f"resume loads the base from model.init_from; resume with model.init_from={old!r} (plait resume <run dir> keeps it)"
    ]


def _setting(key: str, value: Any) -> str:
    """``key=value`` as typed, or that the key is not set (`ABSENT`)."""
    return f"{key} unset" if value is ABSENT else f"{key}={value!r}"


def _differs(key: str, old: Any, now: Any, source: str) -> str:
    """What changed of ``key`` since ``source`` was written, in words that read right when either side lacks it."""
    if old is ABSENT:
        return f"{key}={now!r} is not set in {source}"
    if now is ABSENT:
        return f"{key} is not set, where {source} has {key}={old!r}"
    return f"{key}={now!r} differs from {old!r} in {source}"


def _as_saved(key: str, old: Any) -> str:
    """How to resume with the saved value of ``key``: ``with key=old``, or ``without key``."""
    return f"without {key}" if old is ABSENT else f"with {key}={old!r}"
