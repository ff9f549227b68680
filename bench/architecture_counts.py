"""Architecture counts of plait's code, each an AST walk anyone can repeat (issue 33's "Done when").

Invocation::

    python bench/architecture_counts.py            # every count, one ``<name> <n>`` line each, then the sites
    python bench/architecture_counts.py --quiet    # the count lines only
    git archive main trainer strategies | tar -x -C /tmp/main-tree
    python bench/architecture_counts.py --root /tmp/main-tree   # another tree (e.g. before a change)

Each count is a function ``<name>(root) -> list[str]`` returning the sites it counts
(``path:line: what``); `COUNTS` lists them. A new count is one function and one entry there.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "strategies")


def python_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> Iterator[Path]:
    """Every ``.py`` file under ``root/<package>`` for each package, in path order."""
    for package in packages:
        yield from sorted((root / package).rglob("*.py"))


def _import_text(node: ast.Import | ast.ImportFrom) -> str:
    names = ", ".join(alias.name for alias in node.names)
    if isinstance(node, ast.Import):
        return f"import {names}"
    return f"from {'.' * node.level}{node.module or ''} import {names}"


def imports_in_functions(root: Path = ROOT) -> list[str]:
    """Every ``import`` statement inside a function (or method) body in trainer/ and strategies/.

    Returns:
        ``path:line: import ...`` per statement (a statement importing several names counts once).
    """
    sites = []
    for path in python_files(root):
        tree = ast.parse(path.read_text(), filename=str(path))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                # a nested function's imports are reached from it too: count each statement once
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _innermost(func, node):
                    sites.append(f"{path.relative_to(root)}:{node.lineno}: {_import_text(node)}")
    return sites


def _innermost(func: ast.AST, target: ast.AST) -> bool:
    """Whether ``target`` lies in ``func`` and in no function nested inside ``func``."""
    for child in ast.iter_child_nodes(func):
        if child is target:
            return True
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if _innermost(child, target):
            return True
    return False


def model_probes(root: Path = ROOT) -> list[str]:
    """Every ``getattr``/``hasattr`` call whose object is a model or module (a name or attribute
    ending in ``model``, ``module``, ``stage`` or ``stage_module``) in trainer/ and strategies/.

    Returns:
        ``path:line: call`` per probe (the protocol's own, in ``model_contract.py``, included).
    """
    sites = []
    for path in python_files(root):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                target = ast.unparse(node.args[0]) if node.args else ""
                if re.search(r"(^|\.)(model|module|stage|stage_module)$", target):
                    sites.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return sites


def technique_names_in_semantics(root: Path = ROOT) -> list[str]:
    """Names of single techniques (LoRA, SAT, exact match, loss chunking) in trainer/semantics.py,
    whose rules belong to their components.

    Returns:
        ``path:line: name`` per occurrence.
    """
    path = root / "trainer" / "semantics.py"
    if not path.exists():
        return []
    pattern = re.compile(r"\b(lora|LoRA|sat|SAT|exact_match|ExactMatch|loss_chunk_tokens|chunk)\b")
    return [
        f"trainer/semantics.py:{i}: {m.group(0)}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for m in pattern.finditer(line)
    ]


def class_path_endswith(root: Path = ROOT) -> list[str]:
    """``endswith(...)`` checks on class paths (a capitalised name, or on a ``_target_``): a
    capability matched by name instead of declared.

    Returns:
        ``path:line: text`` per check.
    """
    pattern = re.compile(r"endswith\([\"'][A-Z]\w+[\"']\)|_target_.*endswith\(")
    return [
        f"{path.relative_to(root)}:{i}: {line.strip()[:80]}"
        for path in python_files(root)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


COUNTS: dict[str, Callable[[Path], list[str]]] = {
    "imports_in_functions": imports_in_functions,
    "model_probes": model_probes,
    "technique_names_in_semantics": technique_names_in_semantics,
    "class_path_endswith": class_path_endswith,
}


def main(argv: list[str]) -> None:
    """Prints ``<name> <n>`` per count, then (without ``--quiet``) its sites indented below it;
    ``--root DIR`` counts the tree under DIR instead of this checkout."""
    quiet = "--quiet" in argv
    root = Path(argv[argv.index("--root") + 1]) if "--root" in argv else ROOT
    for name, count in COUNTS.items():
        sites = count(root)
        print(f"{name} {len(sites)}")
        if not quiet:
            print("\n".join(f"  {site}" for site in sites))


if __name__ == "__main__":
    main(sys.argv[1:])
