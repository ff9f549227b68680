"""Bad configs and bad data through the real CLI: exit code and first message line of each, as a table.

Every case should end with one ``plait: error:`` that names the fix, exit code 2, no traceback and
no run directory. Run it in any checkout (its own ``trainer`` package is used), e.g. on the commit
before a change and after it, to fill a before/after table::

    python bench/bad_inputs.py                        # every case, markdown table on stdout
    python bench/bad_inputs.py --only lr_nan,sft_bad_role
    python bench/bad_inputs.py --tree /path/to/other/checkout

The last line is ``RESULT cases=<n> clean=<n> unclean=<names>`` (clean: exit 2, ``plait: error:``,
no traceback, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = [
    "model=nano", "data.seq_len=64", "data.eval_rows=8", "train.global_batch_size=8", "train.micro_batch_size=4",
    "train.eval_every=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.max_steps=4",
]  # fmt: skip
SFT = [
    "sft",
    "model=nano",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "trainer.enable_progress_bar=false",
    "trainer.max_steps=2",
    "data.seq_len=64",
    "data.vocab_size=300",
    "~data.sources",
]
DPO = ["dpo", *SFT[1:8], "data.max_prompt_len=32", "data.vocab_size=300", "~data.sources"]


def _sft(file: str) -> list[str]:
    return [*SFT, f"+data.sources={{f:{{source:{file},weight:1.0,max_tokens:null,max_epochs:1.0,val_size:2}}}}"]


def _dpo(file: str) -> list[str]:
    return [*DPO, f"+data.sources={{f:{{source:{file},limit:null,val_size:2}}}}"]


def _chat(i: int, role: str = "assistant", content: object = None) -> dict:
    return {"messages": [{"role": "user", "content": f"say {i}"}, {"role": role, "content": content or f"ok {i} ok"}]}


def _pair(i: int, chosen: object = None, rejected: object = None) -> dict:
    return {"prompt": f"q{i}", "chosen": chosen or f"good {i}", "rejected": rejected or f"bad {i}"}


def _jsonl(rows: list[object], bad: str | None = None, at: int = 5) -> str:
    lines = [json.dumps(r) for r in rows]
    if bad is not None:
        lines.insert(at, bad)
    return "\n".join(lines) + "\n"


# name -> (CLI arguments after the recipe defaults, {file name: content}); {dir} is the case's directory.
CONFIGS: dict[str, list[str]] = {
    "lr_nan": ["optim.lr=nan"], "lr_negative": ["optim.lr=-1"], "lr_inf": ["optim.lr=inf"], "lr_text": ["optim.lr=abc"],
    "weight_decay_negative": ["optim.weight_decay=-0.1"], "betas_above_1": ["optim.betas=[1.5,0.999]"],
    "betas_one_value": ["optim.betas=[0.9]"], "eps_negative": ["optim.eps=-1e-8"],
    "sgd_momentum_negative": ["optim=sgd", "optim.momentum=-1"],
    "warmup_negative": ["scheduler.warmup_steps=-1"], "min_lr_ratio_2": ["scheduler.min_lr_ratio=2"],
    "timeout_zero": ["strategy.timeout_s=0"], "timeout_negative": ["strategy.timeout_s=-5"],
    "accelerator_gpu_without_gpu": ["trainer.accelerator=gpu"],
    "num_nodes_2_without_launcher": ["trainer.num_nodes=2"], "devices_zero": ["trainer.devices=0"],
    "max_steps_zero": ["trainer.max_steps=0"], "max_steps_negative": ["trainer.max_steps=-5"],
    "log_every_negative": ["trainer.log_every_n_steps=-1"], "limit_batches_negative": ["trainer.limit_train_batches=-1"],
    "run_dir_is_a_file": ["run_dir={dir}/a_file"], "run_dir_under_a_file": ["run_dir={dir}/a_file/run"],
    "val_fraction_above_1": ["data.val_fraction=1.5"], "val_fraction_negative": ["data.val_fraction=-0.1"],
    "vocab_tiny": ["data.vocab_size=10"], "seq_len_zero": ["data.seq_len=0"], "eval_rows_negative": ["data.eval_rows=-1"],
    "dim_zero": ["model.dim=0"], "dim_negative": ["model.dim=-64"], "heads_zero": ["model.n_heads=0"],
    "layers_zero": ["model.n_layers=0"], "kv_heads_not_dividing": ["model.n_kv_heads=3"],
    "dim_not_divisible_by_heads": ["model.dim=65"], "max_seq_len_zero": ["model.max_seq_len=0"],
    "norm_eps_negative": ["model.norm_eps=-1"],
    "max_grad_norm_negative": ["train.max_grad_norm=-1"], "global_batch_zero": ["train.global_batch_size=0"],
    "micro_batch_zero": ["train.micro_batch_size=0"], "eval_every_negative": ["train.eval_every=-1"],
    "seed_negative": ["seed=-1"], "keep_last_negative": ["callbacks.checkpoint.keep_last=-1"],
    "every_n_steps_negative": ["callbacks.checkpoint.every_n_steps=-1"], "throughput_window_zero": ["callbacks.throughput.window=0"],
    "nonfinite_unknown": ["train.nonfinite=never"], "max_nonfinite_zero": ["train.max_nonfinite_steps=0"],
    "heartbeat_above_timeout": ["strategy.heartbeat_s=900"], "resume_missing": ["resume={dir}/nothing"],
}  # fmt: skip
GOOD_CHATS = [_chat(i) for i in range(40)]
GOOD_PAIRS = [_pair(i) for i in range(40)]
DATA: dict[str, tuple[list[str], dict[str, str]]] = {
    "text_empty_file": (["data.path={dir}/d.txt"], {"d.txt": ""}),
    "text_jsonl_without_text": (["data.path={dir}/d.jsonl"], {"d.jsonl": _jsonl([{"body": "x y"}] * 20)}),
    "text_binary_file": (["data.path={dir}/d.txt"], {"d.txt": "\x00\x01\xff\xfe" * 1000}),
    "text_8mb_line_no_whitespace": (["data.path={dir}/d.txt"], {"d.txt": "a" * (8 << 20) + "\n"}),
    "sft_malformed_json": (_sft("{dir}/d.jsonl"), {"d.jsonl": _jsonl(GOOD_CHATS, bad='{"messages": [')}),
    "sft_bad_role": (_sft("{dir}/d.jsonl"), {"d.jsonl": _jsonl(GOOD_CHATS + [_chat(99, role="wizard")])}),
    "sft_content_not_text": (_sft("{dir}/d.jsonl"), {"d.jsonl": _jsonl(GOOD_CHATS + [_chat(99, content=[1, 2])])}),
    "sft_empty_file": (_sft("{dir}/d.jsonl"), {"d.jsonl": ""}),
    "sft_no_assistant_turn": (_sft("{dir}/d.jsonl"), {"d.jsonl": _jsonl([{"messages": [{"role": "user", "content": "hi"}]}] * 20)}),
    "dpo_malformed_json": (_dpo("{dir}/d.jsonl"), {"d.jsonl": _jsonl(GOOD_PAIRS, bad='{"prompt": "q", "chosen"')}),
    "dpo_chosen_equals_rejected": (_dpo("{dir}/d.jsonl"), {"d.jsonl": _jsonl(GOOD_PAIRS + [_pair(99, "same", "same")])}),
    "dpo_missing_rejected": (_dpo("{dir}/d.jsonl"), {"d.jsonl": _jsonl(GOOD_PAIRS + [{"prompt": "q", "chosen": "a"}])}),
    "dpo_chosen_not_text": (_dpo("{dir}/d.jsonl"), {"d.jsonl": _jsonl(GOOD_PAIRS + [_pair(99, chosen=7)])}),
}  # fmt: skip


def run_case(name: str, tree: Path, work: Path, timeout: float) -> dict[str, object]:
    """Runs one case in ``work``; returns its exit code, first message line and what it left."""
    work.mkdir(parents=True)
    (work / "a_file").write_text("not a directory\n")
    if name in CONFIGS:
        args = ["pretrain", *TINY, *CONFIGS[name]]
    else:
        args, files = DATA[name]
        if args[0] not in ("sft", "dpo"):
            args = ["pretrain", *TINY, *args]
        for file, content in files.items():
            (work / file).write_text(content, encoding="utf-8", errors="surrogateescape")
    args = [a.replace("{dir}", str(work)) for a in args]
    if not any(a.startswith("run_dir=") for a in args):
        args.append(f"run_dir={work / 'run'}")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PLAIT_CACHE_DIR": os.environ.get("PLAIT_CACHE_DIR", str(work / "cache")),
    }
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "trainer.cli", *args],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        code, out = done.returncode, done.stderr + done.stdout
    except subprocess.TimeoutExpired as err:
        code, out = (
            "timeout",
            (err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or ""),
        )
    all_lines = out.splitlines()
    errors = [line for line in all_lines if line.startswith("plait: error:")]
    if errors and errors[0].rstrip().endswith("invalid configuration:"):  # the problems follow, one per line
        at = all_lines.index(errors[0])
        errors[0] += " " + " ".join(line.strip() for line in all_lines[at + 1 : at + 3] if line.startswith("  - "))
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith(("[W", "[rank"))]
    first = (
        errors[0]
        if errors
        else (next((l for l in reversed(lines) if "Error" in l or "error" in l), lines[-1] if lines else ""))
    )
    written = (work / "run").exists() or any(p.is_dir() for p in work.glob("a_file*"))
    clean = code == 2 and bool(errors) and "Traceback" not in out and not written
    return {
        "name": name,
        "code": code,
        "first": first[:160],
        "traceback": "Traceback" in out,
        "written": written,
        "seconds": round(time.monotonic() - start, 1),
        "clean": clean,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to run")
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or [*CONFIGS, *DATA]
    results = []
    print("| case | exit | traceback | wrote | first line |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="plait-bad-") as tmp:
        for name in names:
            r = run_case(name, args.tree.resolve(), Path(tmp) / name, args.timeout)
            results.append(r)
            first = str(r["first"]).replace("|", "\\|")
            print(
                f"| {name} | {r['code']} | {'yes' if r['traceback'] else 'no'} | {'yes' if r['written'] else 'no'} | {first} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    unclean = [r["name"] for r in results if not r["clean"]]
    print(f"RESULT cases={len(results)} clean={len(results) - len(unclean)} unclean={','.join(unclean) or 'none'}")


if __name__ == "__main__":
    main()
