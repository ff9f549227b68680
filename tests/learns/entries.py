"""The learning tier's entries: what each recipe trains, and the held-out checks its run must pass.

Every check is a measure read off the run (`Check`) and a threshold set from measured runs with a
margin. A preference objective is held to what only its preference term gives: its run must push
the rejected answers' held-out reward down (supervised training on the chosen answers alone, the
control each threshold was set against, raises it), and keep the chosen ones ahead. Local SGD must
synchronise (bytes sent between islands), not only reach a loss local training reaches alone.

The tasks (all synthetic and verifiable but the corpus):

- ``copy`` SFT (trainer.data.synthetic): "copy: k q z m" -> "k q z m"; the ``sft`` entry trains
  it from scratch and is the **base** the fine-tuning entries start from (``model.init_from``), as
  a real pipeline starts DPO from its SFT model;
- ``copy`` preference pairs (``data=preference_synthetic``): the rejected answer has one letter the
  prompt does not contain; held-out prompts are disjoint from the training ones. The preference
  entries start from the SFT base (and its BPE); ``dpo_preset`` trains the preset as the README
  runs it, from scratch on the preset's own BPE and lengths (a preset that cuts the prompts, as
  83bde6a's did, leaves it near chance);
- ``addition`` SFT stopped early, then GRPO on the same prompts (``grpo``: online RL, exact-answer reward);
- ``reversal`` SFT: the fine-tuning entries' new skill (LoRA, QLoRA, Mixout, SAT from the base);
  ``reversal`` and ``sorting``: the mSFT search's two sources;
- Countdown search traces (trainer.rest.sos) for ``rest``: round 0 on the symbolic searcher's traces,
  one guided self-training round, scored by the solve rate and legal lines of held-out greedy traces;
- the bundled corpus (Shakespeare + King James Bible) for the pretraining entries.

Measured values and the controls behind the thresholds: docs/benchmarks.md ("The learning tier").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from learns.checks import (
    Check,
    Result,
    at_least,
    at_most,
    bytes_sent,
    final_val,
    kto_margin,
    merged_gain,
    msft_final_loss,
    rest_legal_lines,
    rest_solve_rate,
    val_change,
)


@dataclass(frozen=True)
class Entry:
    """One recipe of the tier.

    Args:
        recipe: the bundled recipe (``pretrain``, ``sft``, ``dpo`` ...); ``merge`` for PAFT's merge.
        overrides: Hydra overrides after the runner's common ones.
        checks: what the run must reach (every check).
        base: the entry whose run this one starts from (``model.init_from``).
        devices: processes (2: a layout that needs two ranks).
        merge: PAFT: the two arm entries whose deltas are merged into ``base``.
        long: an entry several times longer than the others: the tier starts it first, so the
            rest of the tier runs beside it instead of after it.
    """

    recipe: str
    overrides: tuple[str, ...]
    checks: tuple[Check, ...]
    base: str | None = None
    devices: int = 1
    merge: tuple[str, ...] = field(default=())
    long: bool = False


# ------------------------------------------------------------------------------------------ tasks
NANO = ("model=nano", "model.max_seq_len=64")
NANO_REST = ("model=nano", "model.max_seq_len=512")
COPY_SFT = (
    "data=synthetic",
    "~data.sources.reversal",
    "~data.sources.sorting",
    "~data.sources.addition",
    "+data.sources.copy={source: copy, limit: 2000, val_size: 64, max_epochs: 10}",
)
REVERSAL_SFT = (
    "data=synthetic",
    "~data.sources.sorting",
    "~data.sources.addition",
    "data.sources.reversal={source: reversal, limit: 1000, val_size: 64, max_epochs: 10}",
)
ADDITION_SFT = (
    "data=synthetic",
    "~data.sources.reversal",
    "~data.sources.sorting",
    "data.sources.addition.limit=4000",
    "data.sources.addition.val_size=256",
)
MSFT_DATA = (
    "data=synthetic",
    "~data.sources.addition",
    "data.sources.reversal.limit=300",
    "data.sources.sorting.limit=300",
    "data.sources.reversal.metric=loss",
    "data.sources.sorting.metric=loss",
)
PAIRS = ("data=preference_synthetic", "data.sources.copy.limit=2000")
TEXT = ("data.seq_len=64", "data.eval_rows=32", "trainer.max_steps=80", "optim.lr=3e-3")
MOE = (
    "model=moe_tiny",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.num_experts=4",
    "model.top_k=2",
    "model.moe_ffn_dim=64",
    "model.n_dense_layers=0",
    "model.max_seq_len=64",
)
# The families' presets at the nano size (width 64, 2 blocks); SmolLM3's NoPE layer is its second,
# Gemma 3's first block attends within 16 tokens of the 64-token rows.
FAMILY_NANO = ("model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64")
STEADY = ("scheduler=constant", "scheduler.warmup_steps=5", "train.global_batch_size=32")


def _pairs(objective: str, *extra: str) -> tuple[str, ...]:
    return (*PAIRS, f"objective={objective}", *STEADY, "optim.lr=1e-3", "trainer.max_steps=60", *extra)


def _reversal(*extra: str) -> tuple[str, ...]:
    return (*REVERSAL_SFT, *STEADY, "optim.lr=3e-3", "trainer.max_steps=60", *extra)


VAL_LOSS_PRETRAIN = at_most(final_val("val/loss"), 6.5)  # from ln(4096) = 8.32
VAL_LOSS_REVERSAL = at_most(final_val("val/loss"), 1.5)  # the base scores 4.16 on reversal

ENTRIES: dict[str, Entry] = {
    # docs/recipes.md's verifiable-pairs DPO (plait dpo data=preference_synthetic model=nano
    # objective.beta=1.0) from scratch, as bench/dpo.py runs it for 2000 steps.
    "dpo_preset": Entry(
        "dpo",
        (
            "model=nano",
            "data=preference_synthetic",
            "data.sources.copy.limit=4000",
            "data.sources.copy.val_size=256",
            "objective.beta=1.0",
            "train.global_batch_size=32",
            "optim.lr=3e-3",
            "scheduler=constant",
            "scheduler.warmup_steps=20",
            "trainer.max_steps=350",
        ),
        (at_least(val_change("val/rewards/accuracy"), 0.3), at_most(val_change("val/rewards/rejected"), -3.0)),
        long=True,  # about 95 s beside the suite, the tier's longest
    ),
    # Chat SFT (default template, loss on the assistant tokens only) from scratch: the base below.
    "sft": Entry(
        "sft",
        (
            *NANO,
            *COPY_SFT,
            "train.global_batch_size=32",
            "optim.lr=3e-3",
            "scheduler=constant",
            "scheduler.warmup_steps=10",
            "trainer.max_steps=250",
        ),
        (at_most(final_val("val/loss"), 1.5),),
    ),
    # Preference objectives from the SFT base, which already prefers the chosen answers: each must
    # push the rejected ones down, which training on the chosen answers alone does not. Each check
    # is a change from step 0, where the reference is the policy (accuracy 0.5, rewards 0): a
    # reward without the reference (beta log p) already reads 0.969 accuracy and -12.8 rejected
    # at step 0 on this base, and passed the absolute thresholds before any step (a reviewer's
    # mutant, `logps - 0 * ref_logps`: +0.015 accuracy by step 60, where DPO gains +0.352).
    "dpo": Entry(
        "dpo",
        _pairs("dpo", "objective.beta=1.0"),
        (at_least(val_change("val/rewards/accuracy"), 0.25), at_most(val_change("val/rewards/rejected"), -1.0)),
        base="sft",
    ),
    "ipo": Entry(
        "ipo",
        _pairs("ipo"),
        (at_least(val_change("val/rewards/accuracy"), 0.2), at_most(val_change("val/rewards/rejected"), -0.1)),
        base="sft",
    ),
    "simpo": Entry(
        "simpo",
        _pairs("simpo"),
        (at_least(val_change("val/rewards/margin"), 0.4), at_most(val_change("val/rewards/rejected"), -1.0)),
        base="sft",
    ),
    # ORPO's odds-ratio term at the paper's lambda = 0.1 is lost under its NLL term from a base
    # that already prefers the chosen answers (the run equals NLL alone to 3 digits); at 1.0 the
    # rejected reward's change sat between +0.03 and -0.06 across CPU kinds: lambda 2, where the
    # rejected rewards fall (-0.075) while the NLL-only control raises them (+0.235).
    "orpo": Entry(
        "orpo",
        _pairs("orpo", "objective.lam=2.0"),
        (at_least(val_change("val/rewards/margin"), 0.2), at_most(val_change("val/rewards/rejected"), 0.0)),
        base="sft",
    ),
    "kto": Entry(
        "kto",
        _pairs("kto"),
        (at_least(kto_margin, 0.08), at_most(val_change("val/rewards/rejected"), -0.5)),
        base="sft",
    ),
    # Fine-tunes of the SFT base on a new task (reversal).
    "lora_sft": Entry("sft", _reversal("+strategy/lora=default"), (VAL_LOSS_REVERSAL,), base="sft"),
    "qlora_sft": Entry(
        "sft", _reversal("+strategy/lora=default", "strategy.lora.quantize=nf4"), (VAL_LOSS_REVERSAL,), base="sft"
    ),
    "mixout_sft": Entry("sft", _reversal("+strategy/mixout=default"), (VAL_LOSS_REVERSAL,), base="sft"),
    "sat_sft": Entry("sft", _reversal("+strategy/sat=default"), (VAL_LOSS_REVERSAL,), base="sft"),
    # PAFT: its SFT arm (more copy SFT, L1 on the delta) and its DPO arm (the dpo entry: the paft
    # recipe with paft=dpo composes the same run) from the SFT base, then their TIES merge into
    # the base, scored on both arms' held-out data. (An SFT arm on another task, reversal or
    # sorting, makes the base forget copying, and the merge then undoes the DPO arm's gain.)
    "paft_sft": Entry(
        "paft",
        ("paft=sft", *COPY_SFT, *STEADY, "optim.lr=3e-3", "trainer.max_steps=60"),
        (at_most(final_val("val/loss"), 1.0),),
        base="sft",
    ),
    "paft_merge": Entry(
        "merge", ("method=ties",), (at_least(merged_gain, 0.3),), base="sft", merge=("paft_sft", "dpo")
    ),
    # Pretraining on the bundled corpus; local SGD must have sent its islands' bytes (local training
    # alone reaches the loss too). DES-LOC averages every 4 steps, inside the golden curve; DiLoCo
    # every 10 (every 4 leaves its outer Nesterov step too little inner progress: 6.82 at step 80).
    "pretrain": Entry("pretrain", (*NANO, *TEXT), (VAL_LOSS_PRETRAIN,)),
    # The model families whose blocks differ from Llama's (post-norm + projection QK-norm; NoPE).
    "olmo2": Entry("pretrain", ("model=olmo2_tiny", *FAMILY_NANO, *TEXT), (VAL_LOSS_PRETRAIN,)),
    "smollm3": Entry(
        "pretrain", ("model=smollm3_tiny", *FAMILY_NANO, "model.nope_layers=[1]", *TEXT), (VAL_LOSS_PRETRAIN,)
    ),
    "gemma3": Entry(
        "pretrain",
        ("model=gemma3_tiny", *FAMILY_NANO, "model.window_layers=[0]", "model.sliding_window=16", *TEXT),
        (VAL_LOSS_PRETRAIN,),
    ),
    # DeepSeek-V3: latent attention, a dense first block, group-limited sigmoid routing, a shared expert.
    "deepseek_v3": Entry("pretrain", ("model=deepseek_v3_tiny", *FAMILY_NANO, *TEXT), (VAL_LOSS_PRETRAIN,)),
    # GPT-OSS: sinks, q/k/v/o biases, windows of 16 in the 64-token rows, biased clamped-SwiGLU experts.
    "gpt_oss": Entry(
        "pretrain",
        ("model=gpt_oss_tiny", *FAMILY_NANO, "model.window_layers=[0]", "model.sliding_window=16", *TEXT),
        (VAL_LOSS_PRETRAIN,),
    ),
    "moe_ep": Entry(
        "pretrain", (*MOE, *TEXT, "strategy=nd", "strategy.expert_parallel.ep=2"), (VAL_LOSS_PRETRAIN,), devices=2
    ),
    "diloco": Entry(
        "pretrain",
        (*NANO, *TEXT, "strategy=diloco", "strategy.local_sgd.sync_every=10"),
        (VAL_LOSS_PRETRAIN, at_least(bytes_sent, 1.0)),
        devices=2,
    ),
    "desloc": Entry(
        "pretrain",
        (
            *NANO,
            *TEXT,
            "strategy=desloc",
            "strategy.local_sgd.param_every=4",
            "strategy.local_sgd.exp_avg_every=8",
            "strategy.local_sgd.exp_avg_sq_every=16",
        ),
        (VAL_LOSS_PRETRAIN, at_least(bytes_sent, 1.0)),
        devices=2,
    ),
    # Online RL: an addition SFT model stopped early (about a quarter of the held-out sums right),
    # then GRPO on the same task's prompts with the exact-answer reward; the share of held-out
    # prompts whose greedy completion is exactly the sum must rise (bench/grpo.py runs it longer).
    "sft_addition": Entry(
        "sft",
        (
            *NANO,
            *ADDITION_SFT,
            "data.sources.addition.max_epochs=12",
            "train.global_batch_size=32",
            "optim.lr=3e-3",
            "scheduler=constant",
            "scheduler.warmup_steps=20",
            "trainer.max_steps=320",
        ),
        (at_least(final_val("val/exact_match/addition"), 0.05),),
    ),
    "grpo": Entry(
        "grpo",
        (
            *NANO,
            "data.sources.addition.limit=4000",
            "data.sources.addition.val_size=256",
            "objective.max_new_tokens=8",
            "train.global_batch_size=128",
            "optim.lr=3e-4",
            "scheduler=cosine",
            "scheduler.warmup_steps=0",
            "trainer.max_steps=150",
        ),
        (at_least(val_change("val/reward/answer"), 0.1),),
        base="sft_addition",
    ),
    # Guided-ReST on Countdown of two numbers: round 0 on the symbolic searcher's traces from scratch
    # (it solves none held out), then one guided round on the model's own traces with the solutions'
    # landmarks inserted. Three numbers and the tiny model took 200 s alone (about 430 s beside the
    # suite) for a model that solved none held out after either round.
    "rest": Entry(
        "rest",
        (
            *NANO_REST,
            "rest.rounds=1",
            "rest.arms=[guided]",
            "rest.problems.count=2",
            "rest.problems.high=20",
            "rest.problems.train=400",
            "rest.problems.held_out=50",
            "rest.searcher.breadth=1",
            "rest.searcher.max_explored=6",
            "rest.samples=1",
            "rest.max_new_tokens=64",
            "rest.budgets=[64]",
            "rest.round0_steps=150",
            "rest.steps=50",
            "train.global_batch_size=8",
            "optim.lr=3e-3",
        ),
        (at_least(rest_solve_rate, 0.2), at_least(rest_legal_lines, 0.5)),
    ),
    # The mSFT budget search on two synthetic sources, from the SFT base: 3 epochs of compute at
    # lr 1e-3, scored every 5 steps (at 1 epoch, lr 3e-3 and every 10 steps, reversal's first
    # score, before any step, was its best on one CPU kind: the search then trained sorting alone).
    "msft": Entry(
        "sft",
        (
            *MSFT_DATA,
            "budget=msft",
            "budget.compute=3.0",
            "budget.eval_every=5",
            "budget.patience=2",
            "budget.baseline=false",
            *STEADY,
            "optim.lr=1e-3",
        ),
        (at_most(msft_final_loss, 3.0),),
        base="sft",
    ),
}


def passed(name: str, result: Result) -> bool:
    """Whether entry ``name``'s run reached every one of its checks (finite values only)."""
    values = result.get("values")
    return values is not None and all(math.isfinite(v) and c.passes(v) for c, v in zip(ENTRIES[name].checks, values))
