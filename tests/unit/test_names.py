"""The naming rules of docs/architecture.md, checked: one class per name, one entry-point verb per role.

Why a test: three classes called `Replica` (the in-process replica, the launcher's record of a
replica process, the simulator's model of one) read alike in a traceback, a grep or a review, and
nothing stops a fourth. The source is read, not imported, so the check costs no torch import.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "burstrl"

# Each role's process entry point: `run_<role>(cfg...)` in the module its `burstrl` command calls.
ROLE_ENTRIES = {
    "launcher/run.py": "run_launcher",
    "inference/server.py": "run_replica",
    "router/server.py": "run_router",
    "trainer/launch.py": "run_trainer",
    "orchestrator/loop.py": "run_orchestrator",
    "sandbox/daemon.py": "run_sandboxd",
}


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_two_classes_share_a_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, f"classes sharing a name (give each a name for what it is): {shared}"


def test_every_role_module_exposes_its_run_function() -> None:
    trees = _trees()
    for path, entry in ROLE_ENTRIES.items():
        functions = {node.name for node in trees[path].body if isinstance(node, ast.FunctionDef)}
        assert entry in functions, f"{path} has no top-level {entry}()"
