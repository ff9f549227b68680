"""`plait rest`: Guided-ReST self-training rounds on Countdown search traces (``recipes/rest.yaml``).

Implements the self-training stage of "Learning to Better Search with Language Models via Guided
Reinforced Self-Training" (Moon, Park and Song, NeurIPS 2025) beside its baseline, plain ReST
(Gulcehre et al. 2023; Singh et al. 2024, ReST-EM):

- **round 0** (the Stream-of-Search start): the symbolic searcher (`trainer.rest.sos.search_trace`)
  writes a trace for every training problem; the ones that reach the target are the data of a
  plain ``plait sft`` run from scratch (or from the recipe's ``model.init_from``);
- **round k >= 1**, for each arm (``guided``, ``unguided``): the arm's model of round k-1 samples
  ``samples`` traces of every training problem (`trainer.rest.rollouts.sample_traces`); the
  guided arm hands each failed trace to `trainer.rest.guidance.guide` up to
  ``guidance_iterations`` times; the valid traces that reach the target are kept (deduplicated,
  the shortest ``max_per_problem`` of a problem) and a ``plait sft`` run of ``steps`` optimizer
  steps fine-tunes on them, from the arm's last model (``init=last``) or round 0's (``init=base``).
  Both arms train the same steps of packed rows: equal training tokens.

After every fit the round's model decodes the held-out problems greedily and the share solved
within each of ``budgets`` generated tokens is its solve rate (`trainer.rest.rollouts.solve_rates`).
Each round writes ``round_<k>/`` (round 0) or ``round_<k>/<arm>/``: ``traces.jsonl`` (every
sampled trace, kept or not), ``stats.json``, ``train/`` (the fit's run directory with its
checkpoints) and ``eval.json``; the run directory gets ``rest.json``, ``rest.png`` and the table
printed at the end (`trainer.rest.report`).

``resume=last`` continues a run directory: a stage whose output is written is not redone (traces
and stats, then the fit, then eval.json), and a fit stopped midway resumes from its last
checkpoint; every trace's sampling seed is fixed by the run's seed, the round, the problem and
the sample, so a resumed round samples and trains exactly what an uninterrupted one does.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from strategies.core.resolved import ResolvedRun
from trainer.budget.driver import DriverError
from trainer.config import ConfigError
from trainer.export import trained_chat_template
from trainer.init_from import load_init_from
from trainer.rest.problems import problems
from trainer.rest.report import plot, table
from trainer.rest.rollouts import Generator, keep, sample_traces, solve_rates
from trainer.rest.run_dir import check_run_dir, write_json, write_traces
from trainer.rest.sos import search_trace
from trainer.run_model import load_run_model
from trainer.rundir import RunDir

ARMS = ("guided", "unguided")
PROMPT_ROOM = 64  # tokens of a row kept for the chat-rendered prompt (about 30 with a round-0 BPE)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc: a fit then ends on its own when the driver dies
        return None


_LIBC = _libc()  # loaded here: the forked child of a threaded process must not dlopen before its exec


def _die_with_parent() -> None:
    """The fit's process gets SIGKILL when the driver dies (Linux' PR_SET_PDEATHSIG): a killed
    driver leaves no fit running into the run directory it resumes."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)


class GuidedReST:
    """The rounds (module docstring); the ``rest`` node of ``recipes/rest.yaml`` holds its arguments.

    Args:
        rounds: self-training rounds after round 0.
        arms: ``guided`` (Guided-ReST), ``unguided`` (plain ReST), or both (compared in the report).
        problems: ``{train, held_out, count, high, max_target}``: problem counts and
            `trainer.rest.sos.make_problem`'s difficulty.
        searcher: round 0's `trainer.rest.sos.search_trace` options (``breadth``, ``max_explored``).
        samples: K, traces sampled per training problem and round.
        guidance_iterations: N, landmark insertions a failed trace gets at most (guided arm).
        max_per_problem: kept traces per problem at most.
        temperature: sampling temperature of the traces.
        max_new_tokens: the generation budget of a trace (sampling, guidance and evaluation).
        budgets: generation budgets (tokens, each <= max_new_tokens) the solve rate is reported at.
        init: ``last`` (each round fine-tunes the arm's previous model) or ``base`` (round 0's).
        round0_steps: optimizer steps of round 0's fit.
        steps: optimizer steps of every later round's fit.

    Raises:
        ConfigError: every problem of the options, named with its fix.
    """

    def __init__(
        self,
        *,
        rounds: int = 2,
        arms: Sequence[str] = ARMS,
        problems: dict[str, int],
        searcher: dict[str, int],
        samples: int = 4,
        guidance_iterations: int = 2,
        max_per_problem: int = 2,
        temperature: float = 1.0,
        max_new_tokens: int = 256,
        budgets: Sequence[int] = (256,),
        init: str = "last",
        round0_steps: int = 200,
        steps: int = 100,
    ) -> None:
        wrong = []
        if rounds < 1 or samples < 1 or max_per_problem < 1 or guidance_iterations < 0:
            wrong.append(
                "rest.rounds, rest.samples and rest.max_per_problem must be >= 1, rest.guidance_iterations >= 0"
            )
        if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
            wrong.append(f"rest.arms={list(arms)}: give one or both of {list(ARMS)}, each once")
        if init not in ("last", "base"):
            wrong.append(f"rest.init={init}: use last (the arm's previous round) or base (round 0's model)")
        if not budgets or any(b < 1 or b > max_new_tokens for b in budgets):
            wrong.append(f"rest.budgets={list(budgets)}: each in [1, rest.max_new_tokens={max_new_tokens}]")
        if round0_steps < 1 or steps < 1:
            wrong.append("rest.round0_steps and rest.steps must be >= 1")
        if wrong:
            raise ConfigError(wrong)
        self.rounds, self.arms, self.problem_args, self.searcher = rounds, list(arms), dict(problems), dict(searcher)
        self.samples, self.guidance_iterations, self.max_per_problem = samples, guidance_iterations, max_per_problem
        self.temperature, self.max_new_tokens, self.budgets = temperature, max_new_tokens, sorted(budgets)
        self.init, self.round0_steps, self.steps = init, round0_steps, steps

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """`trainer.protocols.Component.problems` of the ``rest`` node, for `trainer.config.validate`:
        the options (the constructor's checks), whether the difficulty has the problems asked for,
        and room in a row for a trace of ``max_new_tokens`` after its prompt."""
        args = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
        try:
            driver = cls(**args)
            _ = problems(0, **driver.problem_args)
        except ConfigError as err:
            return list(err.problems)
        except TypeError:  # a missing or unknown argument: the target checks report it
            return []
        if run is not None and driver.max_new_tokens + PROMPT_ROOM > run.seq_len:
            return [
                f"rest.max_new_tokens={driver.max_new_tokens} leaves no room for the prompt in data.seq_len="
                f"{run.seq_len} (a trained row holds both): raise data.seq_len to at least "
                f"{driver.max_new_tokens + PROMPT_ROOM} or lower rest.max_new_tokens"
            ]
        return []

    # ---------------------------------------------------------------------------------- stages
    def round_config(
        self,
        cfg: DictConfig,
        train_dir: Path,
        traces: Path,
        *,
        steps: int,
        init_from: str | None,
        tokenizer: str | None,
    ) -> DictConfig:
        """``cfg`` for one round's fit: SFT on ``traces`` for ``steps`` optimizer steps."""
        out = copy.deepcopy(cfg)
        OmegaConf.resolve(out)
        with open_dict(out):
            out.rest, out.run_dir = None, str(train_dir)
            out.resume = "last" if RunDir(train_dir).holds_checkpoints() else None
            out.trainer.max_steps = steps
            # as many supervised tokens as the steps' rows can hold: the traces repeat until the steps end
            budget = steps * int(out.train.global_batch_size) * int(out.data.seq_len)
            out.data.sources = {
                "traces": {
                    "source": str(traces),
                    "weight": 1.0,
                    "max_tokens": budget,
                    "max_epochs": None,
                    "val_size": 0,
                    # the rows' prompt and completion are strings; the rollouts prompt through the chat template
                    "string_rows": "chat",
                }
            }
            out.data.tokenizer = tokenizer
            out.model.init_from = init_from
        return out

    def fit(self, cfg: DictConfig, fit_file: Path) -> None:
        """Fits one round's config as a ``plait`` run of its own: ``cfg`` is written to ``fit_file``
        (the round's record of what it trained, a recipe file) and ``python -m trainer.cli
        fit_file`` trains it, resuming the run directory's last checkpoint when it has one.

        A process of its own, not a fork of this one: this process samples with torch's threads,
        and a forked child of a process that has used them hangs in its first parallel region.

        Raises:
            DriverError: the fit exited with an error (its own message is above).
        """
        train_dir = Path(cfg.run_dir)
        if RunDir(train_dir).summary.is_file():
            return  # this fit finished before a kill
        if train_dir.exists() and not RunDir(train_dir).holds_checkpoints():
            shutil.rmtree(train_dir)  # killed before its first checkpoint: start it again
        tmp = fit_file.with_suffix(".tmp")
        tmp.write_text("defaults:\n  - plait_base\n  - _self_\n\n" + OmegaConf.to_yaml(cfg))
        os.replace(tmp, fit_file)
        code = subprocess.run(
            [sys.executable, "-m", "trainer.cli", str(fit_file)], check=False, preexec_fn=_die_with_parent
        ).returncode
        if code != 0:
            raise DriverError(
                f"the fit of {fit_file} exited with {code} (its error is above); fix it and continue with resume=last"
            )

    def generator(self, train_dir: Path) -> Generator:
        run = load_run_model(train_dir, load_base=load_init_from)
        return Generator(run.model, run.tokenizer, trained_chat_template(run))

    def evaluate(self, round_dir: Path, held_out: list[dict]) -> dict:
        path = round_dir / "eval.json"
        if path.is_file():
            return json.loads(path.read_text())
        result = solve_rates(self.generator(round_dir / "train"), held_out, self.budgets)
        write_json(path, result)
        return result

    def symbolic_traces(self, round_dir: Path, train: list[dict]) -> dict:
        """Round 0's data: the searcher's trace of every training problem (the solved ones trained on)."""
        if (round_dir / "stats.json").is_file():
            return json.loads((round_dir / "stats.json").read_text())
        records = []
        for i, p in enumerate(train):
            text, solved = search_trace(p["numbers"], p["target"], **self.searcher)
            records.append({"problem": i, "sample": 0, "text": text, "guided": 0, "valid": True, "solved": solved})
        write_traces(round_dir / "traces.jsonl", train, [r for r in records if r["solved"]])
        stats = {
            "sampled": len(records),
            "solved": sum(r["solved"] for r in records),
            "kept": sum(r["solved"] for r in records),
        }
        stats["mean_chars"] = sum(len(r["text"]) for r in records if r["solved"]) / max(stats["kept"], 1)
        write_json(round_dir / "stats.json", stats)
        return stats

    def model_traces(
        self, round_dir: Path, previous: Path, train: list[dict], *, round_index: int, guided: bool, seed: int
    ) -> dict:
        """Round ``round_index``'s data for one arm: traces sampled from ``previous`` (a fit's run directory)."""
        if (round_dir / "stats.json").is_file():
            return json.loads((round_dir / "stats.json").read_text())
        traces = sample_traces(
            self.generator(previous),
            train,
            samples=self.samples,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=seed,
            round_index=round_index,
            guidance_iterations=self.guidance_iterations if guided else 0,
        )
        kept = keep(traces, max_per_problem=self.max_per_problem)
        write_traces(round_dir / "traces.jsonl", train, [t.record() for t in kept])
        write_traces(round_dir / "sampled.jsonl", train, [t.record() for t in traces])
        stats = {
            "sampled": len(traces),
            "valid": sum(t.valid for t in traces),
            "solved": sum(t.solved for t in traces),
            "solved_guided": sum(t.solved and t.guided > 0 for t in traces),
            "problems_solved": len({t.problem for t in traces if t.solved}),
            "kept": len(kept),
            "mean_tokens_kept": sum(t.tokens for t in kept) / max(len(kept), 1),
            "mean_tokens": sum(t.tokens for t in traces) / len(traces),
        }
        write_json(round_dir / "stats.json", stats)
        return stats

    # ---------------------------------------------------------------------------------- the loop
    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        """Every round of every arm, then ``rest.json``, ``rest.png`` and the printed table."""
        run_dir = Path(run_dir)
        check_run_dir(cfg, run_dir)
        train, held_out = problems(cfg.seed, **self.problem_args)
        say = lambda line: print(f"plait: rest: {line}", file=sys.stderr, flush=True)
        report: dict[str, Any] = {"arms": {}, "budgets": self.budgets, "problems": self.problem_args}
        round0 = run_dir / "round_0"
        round0.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "config.yaml").is_file():
            OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)  # what check_run_dir holds a resume to
        say(
            f"round 0 trains rest.round0_steps={self.round0_steps} steps and each later round rest.steps={self.steps}; "
            f"trainer.max_steps={cfg.trainer.max_steps} does not apply"
        )
        stats0 = self.symbolic_traces(round0, train)
        say(
            f"round 0: the searcher solved {stats0['solved']} of {stats0['sampled']} training problems; training on them"
        )
        cfg0 = self.round_config(
            cfg,
            round0 / "train",
            round0 / "traces.jsonl",
            steps=self.round0_steps,
            init_from=cfg.model.init_from,
            tokenizer=cfg.data.tokenizer,
        )
        self.fit(cfg0, round0 / "fit.yaml")
        eval0 = self.evaluate(round0, held_out)
        say(f"round 0: held-out solve rate {self._rate(eval0):.3f} at {self.budgets[-1]} tokens")
        tokenizer = str(RunDir(round0 / "train").tokenizer)
        entry0 = {
            "round": 0,
            "stats": stats0,
            "solve_rate": eval0["solve_rate"],
            "valid": eval0["valid"],
            "legal_lines": eval0["legal_lines"],
            "train_tokens": self._tokens(round0),
        }
        for arm in self.arms:
            report["arms"][arm] = [entry0]
            previous = round0 / "train"
            for k in range(1, self.rounds + 1):
                round_dir = run_dir / f"round_{k}" / arm
                round_dir.mkdir(parents=True, exist_ok=True)
                stats = self.model_traces(
                    round_dir, previous, train, round_index=k, guided=arm == "guided", seed=cfg.seed
                )
                say(f"round {k} {arm}: {stats['solved']} of {stats['sampled']} traces solved, {stats['kept']} kept")
                if stats["kept"] == 0:  # nothing to fine-tune on: the arm's model stays as it was
                    say(
                        f"warning: round {k} {arm}: no sampled trace is valid and solved, so the round trains nothing "
                        "and keeps the arm's model; train round 0 longer (rest.round0_steps) or raise rest.samples"
                    )
                    report["arms"][arm].append(
                        {**report["arms"][arm][-1], "round": k, "stats": stats, "train_tokens": 0}
                    )
                    continue
                init_from = str(previous if self.init == "last" else round0 / "train")
                round_cfg = self.round_config(
                    cfg,
                    round_dir / "train",
                    round_dir / "traces.jsonl",
                    steps=self.steps,
                    init_from=init_from,
                    tokenizer=tokenizer,
                )
                self.fit(round_cfg, round_dir / "fit.yaml")
                result = self.evaluate(round_dir, held_out)
                say(f"round {k} {arm}: held-out solve rate {self._rate(result):.3f} at {self.budgets[-1]} tokens")
                report["arms"][arm].append(
                    {
                        "round": k,
                        "stats": stats,
                        "solve_rate": result["solve_rate"],
                        "valid": result["valid"],
                        "legal_lines": result["legal_lines"],
                        "train_tokens": self._tokens(round_dir),
                    }
                )
                previous = round_dir / "train"
        write_json(run_dir / "rest.json", report)
        plot(report, run_dir / "rest.png")
        print(table(report))
        return report

    @staticmethod
    def _rate(result: dict) -> float:
        return max(result["solve_rate"].items(), key=lambda kv: int(kv[0]))[1]

    @staticmethod
    def _tokens(round_dir: Path) -> int:
        summary = json.loads(RunDir(round_dir / "train").summary.read_text())
        return int(summary["tokens_seen"])
