"""``plait merge base=... deltas=[...] method=ties``: merge fine-tuned models into their base (PAFT).

PAFT (Pentyala et al. 2024, "PAFT: A Parallel Training Paradigm for Effective LLM Fine-Tuning")
fine-tunes SFT and DPO separately from one base and adds both deltas ``delta_i = theta_i -
theta_base`` back to the base. Methods, per parameter tensor:

- ``task_arithmetic`` (Ilharco et al. 2023, "Editing Models with Task Arithmetic"):
  ``theta = theta_base + scale x sum_i w_i delta_i``, computed in fp64 as ``(1 - scale x sum w)
  theta_base + scale x sum_i w_i theta_i`` so that one model at weight 1 comes back bit for bit;
- ``ties`` (Yadav et al. 2023, "TIES-Merging"): trim each delta to its ``density`` largest
  magnitudes (per tensor), elect per entry the sign of the sum of the trimmed (weighted) deltas,
  take the mean of the entries that agree with it ("disjoint mean"), scale and add to the base;
- ``dare`` (Yu et al. 2024, "Language Models are Super Mario"): drop each delta entry with
  probability ``drop`` (seeded), rescale the kept ones by ``1 / (1 - drop)``, then task arithmetic.

It prints each delta's sparsity (share of exactly-zero entries and of entries with ``|delta| <=
tol``; PAFT: DPO deltas are sparse, SFT deltas dense unless L1-regularised) and writes ``out`` as a
run directory: the base's ``config.yaml``, tokenizer files and ``checkpoints/last`` with
the merged weights (for ``plait generate ckpt=<out>`` and ``model.init_from=<out>``); from a
Hugging Face base, the config, tokenizer and chat template of the first fine-tuned run (``model=hf``
with that base as ``model.init_from``). A plait run among the deltas must have been fine-tuned
from the base (its ``model.init_from``), or the merge is refused.

Invocation::

    plait merge base=runs/base deltas=[runs/sft,runs/dpo] method=ties density=0.2 out=runs/paft
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from strategies.checkpoint.dcp import META_FILE, CheckpointError, seal
from strategies.checkpoint.manifest import digest
from strategies.transforms.lora import adapted_layers, merge_lora
from trainer.compose import compose_command, fail
from trainer.config import ConfigError
from trainer.init_from import load_init_from
from trainer.resume import read_record
from trainer.run_model import RunModel, load_run_model
from trainer.rundir import SUPERSEDED, RunDir, resolve_checkpoint, step_dirs

METHODS = ("task_arithmetic", "ties", "dare")
State = dict[str, torch.Tensor]


def _weights(weights: Sequence[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise ValueError(f"weights has {len(weights)} entries for {n} deltas; give one weight per delta")
    return [float(w) for w in weights]


def task_arithmetic(
    base: State, models: Sequence[State], *, weights: Sequence[float] | None = None, scale: float = 1.0
) -> State:
    """``base + scale x sum_i w_i (model_i - base)`` per tensor (fp64, cast back to base dtype).

    Args:
        base: the base model's state (name -> tensor).
        models: fine-tuned states with the same names and shapes.
        weights: one per model (default 1).
        scale: lambda applied to the summed deltas.
    """
    w = _weights(weights, len(models))
    out = {}
    for name, b in base.items():
        merged = (1.0 - scale * sum(w)) * b.double()
        for wi, m in zip(w, models):
            merged = merged + (scale * wi) * m[name].double()
        out[name] = merged.to(b.dtype)
    return out


def trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """The delta with all but its ``ceil(density x numel)`` largest-magnitude entries set to 0
    (ties at the threshold are kept)."""
    if density >= 1.0:
        return delta.clone()
    k = max(1, int(-(-density * delta.numel() // 1)))
    threshold = delta.abs().flatten().kthvalue(delta.numel() - k + 1).values
    return torch.where(delta.abs() >= threshold, delta, torch.zeros_like(delta))


def ties_delta(
    deltas: Sequence[torch.Tensor], *, density: float, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """TIES's merged delta of one tensor: trim, elect sign, disjoint mean.

    Args:
        deltas: the models' deltas of this tensor (same shape).
        density: share of entries each delta keeps (0 < density <= 1).
        weights: one per delta (default 1); the disjoint mean is weighted by them (a negative one
            negates its delta: the mean divides by their magnitudes).

    Returns:
        ``sum_{i agrees} w_i trimmed_i / sum_{i agrees} |w_i|`` per entry (0 where no delta agrees).
    """
    w = torch.tensor(_weights(weights, len(deltas)), dtype=torch.float64).view(-1, *[1] * deltas[0].dim())
    trimmed = torch.stack([trim(d.double(), density) for d in deltas]) * w
    sign = torch.sign(trimmed.sum(0))
    agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
    total = torch.where(agree, trimmed, 0.0).sum(0)
    count = torch.where(agree, w.abs().expand_as(trimmed), 0.0).sum(0)  # a reviewer: signed, [1, -1] gave 0
    return torch.where(count > 0, total / count.clamp(min=1e-30), 0.0)


def dare(delta: torch.Tensor, *, drop: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: each entry dropped with probability ``drop``, the rest rescaled by ``1/(1 - drop)``."""
    if not 0.0 <= drop < 1.0:
        raise ValueError(f"drop={drop} must be in [0, 1)")
    keep = torch.rand(delta.shape, generator=generator) >= drop
    return torch.where(keep, delta.double() / (1.0 - drop), 0.0)


def merge_states(
    base: State,
    models: Sequence[State],
    *,
    method: str,
    weights: Sequence[float] | None = None,
    scale: float = 1.0,
    density: float = 0.2,
    drop: float = 0.9,
    seed: int = 0,
) -> State:
    """Merges ``models`` into ``base`` with ``method`` (see module docstring).

    Raises:
        ValueError: unknown method, bad density/drop, or states whose names or shapes differ.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {', '.join(METHODS)}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density={density} must be in (0, 1]")
    for i, m in enumerate(models):
        if m.keys() != base.keys() or any(m[k].shape != base[k].shape for k in base):
            raise ValueError(
                f"delta {i} has other parameters than the base (names or shapes differ): not the same architecture"
            )
    if method == "task_arithmetic":
        return task_arithmetic(base, models, weights=weights, scale=scale)
    out = {}
    generator = torch.Generator().manual_seed(seed)
    w = _weights(weights, len(models))
    for name, b in base.items():
        deltas = [m[name].double() - b.double() for m in models]
        if method == "ties":
            merged = ties_delta(deltas, density=density, weights=w)
        else:
            merged = sum(wi * dare(d, drop=drop, generator=generator) for wi, d in zip(w, deltas))
        out[name] = (b.double() + scale * merged).to(b.dtype)
    return out


def sparsity(base: State, model: State, *, tol: float = 1e-6) -> dict[str, float]:
    """Share of delta entries that are exactly 0 (``zero``) and that are ``<= tol`` in magnitude."""
    total = sum(b.numel() for b in base.values())
    zero = sum(int((model[k] == b).sum()) for k, b in base.items())
    small = sum(int(((model[k].double() - b.double()).abs() <= tol).sum()) for k, b in base.items())
    return {"zero": zero / total, f"abs_le_{tol:g}": small / total}


# ------------------------------------------------------------------------------ command
def _load(path: str, trust: Sequence[str] = ()) -> tuple[State, RunModel]:
    """The model state of a checkpoint, run directory or Hugging Face directory, and what
    describes it (``trust`` as in `load_run_model`). A LoRA run's adapters are folded into the
    base it recorded (`merge_lora`), so its state has the base's names.

    Raises:
        ValueError: a LoRA run whose adapters cannot be folded (a tied head).
    """
    run = load_run_model(path, load_base=load_init_from, trust=trust)
    if adapted_layers(run.model):  # a LoRA arm (a reviewer: every one was refused before the base check)
        merge_lora(run.model)
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}, run


def _is_lora(run: RunModel) -> bool:
    """Whether ``run`` is a plait LoRA run (its config's ``strategy.lora``)."""
    return _is_run(run) and bool(OmegaConf.select(run.config, "strategy.lora", default=None))


def _is_run(run: RunModel) -> bool:
    """Whether ``run`` is a plait run (its ``config.yaml``), not a Hugging Face directory."""
    return run.run.config.is_file()


def _weights_of(path: str | os.PathLike) -> Path:
    """The directory whose weights ``path`` names: a plait run's or checkpoint's checkpoint (its
    newest for a run), or the directory itself (a Hugging Face model), canonical."""
    return Path(os.path.realpath(resolve_checkpoint(path) or path))


def base_problems(base: RunModel, deltas: Sequence[tuple[str, RunModel]]) -> list[str]:
    """Each plait run of ``deltas`` that was not fine-tuned from ``base``'s weights: its difference
    from the base is not its fine-tuning. A run records the checkpoint its first step started from
    (`trainer.init_from.started_from`, in every checkpoint's record), compared by content, so a full
    fine-tune whose ``model.init_from`` names a base run that trained on since is caught; a run
    recorded before that is judged by its ``model.init_from`` (another checkpoint, or none). A Hugging
    Face directory among the deltas records no base, and a relative ``model.init_from`` (runs recorded
    before paths were made absolute) names a folder only from where that run started: neither is checked."""
    weights, root = Path(os.path.realpath(base.checkpoint)), Path(os.path.realpath(base.run.path))
    problems = []
    for given, run in deltas:
        if not _is_run(run) or Path(os.path.realpath(run.run.path)) == root:  # the base itself: a zero delta
            continue
        if (started := _recorded_base(run)) is not None:
            if started["digest"] != digest(weights):
                problems.append(_moved_base(given, started, base.checkpoint))
            continue
        init_from = run.config.model.get("init_from")
        if isinstance(init_from, str) and not os.path.isabs(os.path.expanduser(init_from)):
            continue
        start = _weights_of(os.path.expanduser(init_from)) if isinstance(init_from, str) else None
        if start != weights:
            was = f"model.init_from={init_from}" if start is not None else "from scratch (no model.init_from)"
            problems.append(
                f"deltas: {given} was trained {was}, not from base={base.checkpoint}: its difference from the base is not its "
                "fine-tuning; merge runs fine-tuned from one base (PAFT's arms both start from it), with that base"
            )
    return problems


def _recorded_base(run: RunModel) -> dict[str, str] | None:
    """The checkpoint ``run``'s first step started from, as its checkpoint records it (None: not
    recorded, or the record does not read: the run is judged by its ``model.init_from``)."""
    try:
        record = read_record(run.checkpoint)
    except ConfigError:
        return None
    started = record.get("base") if isinstance(record, dict) else None
    return started if isinstance(started, dict) and {"checkpoint", "digest"} <= started.keys() else None


def _moved_base(given: str, started: dict[str, str], base: Path) -> str:
    """The refusal of an arm that started from ``started`` (`_recorded_base`), not from ``base``: it
    names where those weights are now (the checkpoint, or where a resume set it aside), or that they are gone."""
    there = Path(started["checkpoint"])
    candidates = [there, *sorted((there.parent / SUPERSEDED).glob(f"*/{there.name}"))]
    found = next((c for c in candidates if c.is_dir() and digest(c) == started["digest"]), None)
    if found is not None:
        fix = f"merge with base={found}"
    else:
        fix = (
            f"no checkpoint of {there.parent.parent} holds those weights now (the base run's keep_last deletes old "
            "checkpoints), so this arm's fine-tuning cannot be told from the base's: fine-tune it again from the base "
            "you merge with"
        )
    if Path(os.path.realpath(base)) == there:
        was = f"{there} as it was then; that checkpoint holds other weights now (the base run resumed from an earlier step)"
    else:
        was = f"{there}, not from base={base} (other weights: the base run trained on, or another run)"
    return f"deltas: {given} was fine-tuned from the checkpoint {was}; {fix}"


def save_merged(state: State, out: Path, *, like: Path) -> Path:
    """Writes ``state`` as the run directory ``out`` (config, tokenizer and chat template copied from run ``like``)."""
    target, source = RunDir(out), RunDir(like)
    ckpt = target.last
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    for src, dst in zip((source.config, *source.tokenizer_files()), (target.config, *target.tokenizer_files())):
        if src.exists():
            shutil.copy(src, dst)
        else:  # a file left by an earlier merge into ``out`` would describe another run
            dst.unlink(missing_ok=True)
    dcp.save({"model": state}, checkpoint_id=ckpt)
    torch.save({"merged": True}, ckpt / META_FILE)
    seal(ckpt)
    return ckpt


def main(argv: list[str]) -> None:
    """Entry of ``plait merge``: ``key=value`` arguments of conf/merge.yaml; exit 2 on bad input."""
    usage = "plait merge base=<run> deltas=[<run>,...] method=ties"
    cfg = compose_command("merge", argv, usage=usage, lists=("deltas",))
    # A merge's own output (checkpoints/last, a folder) may be written again; a training run's not (a
    # reviewer: rmtree on its `last` link raised).
    out = RunDir(cfg.out) if cfg.out else None
    if out is not None and (out.last.is_symlink() or step_dirs(out.checkpoints)):
        fail(
            f"out={cfg.out} holds a training run's checkpoints; choose a new directory (a merge writes a run of its own)"
        )
    if not cfg.deltas:
        fail(f"deltas=[] names no fine-tuned run to merge; give at least one, e.g. deltas=[runs/sft] (usage: {usage})")
    try:
        base, base_run = _load(cfg.base, cfg.trust)
        loaded = [_load(path, cfg.trust) for path in cfg.deltas]
        models = [state for state, _ in loaded]
        if problems := base_problems(base_run, [(path, run) for path, (_, run) in zip(cfg.deltas, loaded)]):
            fail("\n".join(problems))
        # out is a plait run: the base's config.yaml, or (a Hugging Face base) a fine-tuned run's of that base
        # (not a LoRA arm's: its config.yaml builds adapters on a base, the merged weights are whole)
        runs = [base_run, *(run for _, run in loaded)]
        like = next((run.run.path for run in runs if _is_run(run) and not _is_lora(run)), None)
        if like is None:
            fail(
                f"base={cfg.base} is a Hugging Face directory and no delta is a plait run of whole weights (a LoRA run's "
                "config.yaml builds adapters): out would have no config.yaml to build the merged model from; give a full "
                "fine-tune run among the deltas"
            )
        merged = merge_states(
            base,
            models,
            method=cfg.method,
            weights=cfg.weights,
            scale=cfg.scale,
            density=cfg.density,
            drop=cfg.drop,
            seed=cfg.seed,
        )
    except (FileNotFoundError, ValueError, CheckpointError) as err:  # UntrustedTargetError is a ValueError
        fail(str(err))
    for path, model in zip(cfg.deltas, models):
        s = sparsity(base, model, tol=cfg.tol)
        print(f"delta {path}: " + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))
    s = sparsity(base, merged, tol=cfg.tol)
    print(f"merged delta ({cfg.method}): " + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))
    ckpt = save_merged(merged, Path(cfg.out), like=like)
    print(f"plait: merged model written to {ckpt}")
