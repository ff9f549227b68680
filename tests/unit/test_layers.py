"""The rooms' import rules (docs/architecture.md, "Rooms"), checked on the source with `ast`.

- `strategies.core` (the run's shared types) is the bottom layer: it imports no other plait module.
- Models and data modules import only the bottom layer (`strategies.core`, `trainer.protocols`) and their own
  kind: no parallelism technique, no model code in data and no data code in models.
- Techniques in `strategies/` never import `trainer/` (tests/unit/test_imports.py) and never each other's
  folders (`context`, `expert`, `pipeline`, `local_sgd`, `transforms`); the planner, which models every
  layout, reads theirs and is imported by none of them.
- `ALLOWED` lists the exceptions, each with its reason; one that no longer occurs fails the test too.
"""

from __future__ import annotations

from test_imports import import_graph

BOTTOM = ("strategies.core", "trainer.protocols")
TECHNIQUES = ("context", "expert", "pipeline", "local_sgd", "transforms", "planner")
PACKAGES = ("trainer", "strategies")  # `from trainer import protocols` also names the (docstring-only) package
ALLOWED = {
    # SAT's sliced MLP computes a LoRA-adapted projection on a slice of its features: the model asks the
    # adapter's own slicing. To go when linear layers carry a slicing method of their own.
    ("trainer.models.block", "strategies.transforms.lora"): "LoRA-aware feature slicing (linear_slice)",
    # LoRA on a mixture of experts adapts the stacked expert weights, named by the dispatch module.
    ("strategies.transforms.lora_targets", "strategies.expert.dispatch"): "the stacked expert weights' names",
    # A source with metric: exact_match is scored by greedy decoding: the SFT data module declares its evaluator.
    ("trainer.data.sft", "trainer.evaluators.exact_match"): "the evaluator an SFT source declares",
    # Online RL's prompt data is the task's environment: its prompts, the verifiers that score their completions
    # (data.rewards) and the evaluator that scores held-out greedy completions with them.
    ("trainer.data.prompts", "trainer.rl.rewards"): "the verifiers a prompt source carries",
    ("trainer.data.prompts", "trainer.rl.evaluate"): "the evaluator prompt data declares",
}


def _inside(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import that breaks a rule above."""
    found = []
    for a, targets in graph.items():
        for b in targets:
            if b in PACKAGES or (a, b) in ALLOWED:
                continue
            if _inside(a, ("strategies.core",)) and not _inside(b, ("strategies.core",)):
                found.append(f"{a} -> {b} (the bottom layer imports nothing of plait's)")
            for own in ("trainer.models", "trainer.data"):
                if _inside(a, (own,)) and not _inside(b, (own, *BOTTOM)):
                    found.append(f"{a} -> {b} ({own} imports only {', '.join(BOTTOM)} and itself)")
            if a.startswith("strategies.") and b.startswith("strategies."):
                room_a, room_b = a.split(".")[1], b.split(".")[1]
                if room_a in TECHNIQUES and room_b in TECHNIQUES and room_a != room_b and room_a != "planner":
                    found.append(f"{a} -> {b} (one technique folder imports another)")
    return sorted(found)


def test_rooms_keep_their_import_rules() -> None:
    graph = import_graph()
    assert violations(graph) == []
    assert [pair for pair in ALLOWED if pair[1] not in graph.get(pair[0], set())] == []  # a stale exception goes


def test_a_technique_importing_the_planner_is_found() -> None:
    assert violations({"strategies.pipeline.plugin": {"strategies.planner.time"}}) != []
    assert violations({"strategies.planner.time": {"strategies.pipeline.layout"}}) == []


def test_a_model_importing_a_technique_is_found() -> None:
    graph = {"trainer.models.llama": {"strategies.context.ring", "strategies.core.ranges", "trainer.data.tokenizer"}}
    assert violations(graph) == [
        "trainer.models.llama -> strategies.context.ring (trainer.models imports only strategies.core, trainer.protocols and itself)",
        "trainer.models.llama -> trainer.data.tokenizer (trainer.models imports only strategies.core, trainer.protocols and itself)",
    ]
