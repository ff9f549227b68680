"""Counts of issue 33's "plugin phases" step in the strategy class, for any commit.

Usage (from the repo root)::

    python bench/plugin_phases.py main         # before (6df7b6f): mesh.py + mesh_step.py + mesh_checkpoint.py
    python bench/plugin_phases.py HEAD

Prints, for the strategy class (``MeshStrategy`` and the mixins it inherits from plait, if any):
- ``member_calls``: distinct (plugin, member) pairs the strategy reads on a plugin beyond the
  declared contract (`strategies.plugin`: the ``Plugin`` protocol's methods, or every attribute of
  ``StrategyPlugin`` where that class exists). A plugin is ``self.<attr>`` for an attribute the
  strategy's ``__init__`` sets from a plugin class/argument, or a loop variable named ``plugin``.
- ``is_self``: ``plugin is self.X`` comparisons.
- ``init_args``: ``MeshStrategy.__init__`` arguments (without ``self``).
- ``class_lines``: lines of the strategy class and its plait mixins, and the files they are in.
"""

from __future__ import annotations

import ast
import subprocess
import sys

FILES = ("strategies/mesh.py", "strategies/mesh_step.py", "strategies/mesh_checkpoint.py")
PLUGIN_ATTRS = {
    "fsdp", "tensor_parallel", "context_parallel", "pipeline", "local_sgd", "expert_parallel", "lora", "mixout",
    "sat", "compile_plugin", "activation_offload", "activation_checkpoint",
}  # fmt: skip


def show(rev: str, path: str) -> str | None:
    result = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None


def contract(rev: str) -> set[str]:
    tree = ast.parse(show(rev, "strategies/plugin.py") or "")
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("Plugin", "StrategyPlugin"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
    return names


def receiver(node: ast.expr) -> str | None:
    """The plugin an attribute is read on: ``self.<plugin attr>`` or a loop variable ``plugin``."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr in PLUGIN_ATTRS
    ):
        return node.attr
    if isinstance(node, ast.Name) and node.id == "plugin":
        return "plugin"
    return None


def main(rev: str) -> None:
    hooks = contract(rev)
    classes = {}
    for path in FILES:
        text = show(rev, path)
        if text is None:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name in ("MeshStrategy", "MeshStep", "MeshCheckpoints"):
                classes[node.name] = (path, node)
    calls, is_self, lines = set(), 0, 0
    for path, cls in classes.values():
        lines += cls.end_lineno - cls.lineno + 1
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and (owner := receiver(node.value)) and node.attr not in hooks:
                calls.add(f"{owner}.{node.attr}")
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.Is) for op in node.ops):
                is_self += sum(
                    isinstance(c, ast.Attribute) and isinstance(c.value, ast.Name) and c.value.id == "self"
                    for c in node.comparators
                )
    init = next(f for f in classes["MeshStrategy"][1].body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    init_args = len(init.args.args) - 1 + len(init.args.kwonlyargs)
    print(f"member_calls={len(calls)} {sorted(calls)}")
    print(f"is_self={is_self}")
    print(f"init_args={init_args}")
    print(f"class_lines={lines} files={sorted({p for p, _ in classes.values()})}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "HEAD")
