"""The package map of docs/architecture.md, checked: one-way arrows, no import cycles, light roles torch-free.

Why a test: an arrow drawn the wrong way (the router importing the replica, publishing importing
the replica's engine) costs seconds of start-up and hundreds of MiB in every light process, and
nobody sees it in review. The imports are read from the source (every `import`, at any depth:
lazy ones too), so a cycle hidden in a function body counts.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "burstrl"

# Shared foundations: anyone may import them; they import no role package.
FOUNDATIONS = {"burstrl", "atomic", "config", "deadline", "protocol"}
# Arrows between role packages (foundations left out). Keep in step with docs/architecture.md.
ALLOWED: dict[str, set[str]] = {
    "cli": {"envs", "eval", "inference", "launcher", "model", "orchestrator", "router", "sandbox", "store",
            "trainer"},
    "launcher": {"envs", "eval", "model", "orchestrator", "providers", "sandbox", "store", "trainer", "weights"},
    "eval": {"envs", "orchestrator"},
    "orchestrator": {"envs", "store"},
    "envs": {"model", "sandbox", "trainer"},  # model, trainer: the warm starts load the base and call the SFT
    "trainer": {"model", "store", "weights"},
    "inference": {"model", "weights"},
    "router": set(),
    "weights": set(),
    "providers": set(),
    "model": set(),
    "sandbox": set(),
    "store": set(),
}
# Roles that run in light processes (router, launcher, orchestrator) or that those import.
TORCH_FREE = ("burstrl.router.server", "burstrl.protocol.adapters", "burstrl.protocol.http",
              "burstrl.protocol.process", "burstrl.protocol.versions", "burstrl.weights.push", "burstrl.weights.gc",
              "burstrl.weights.volume", "burstrl.orchestrator.client", "burstrl.providers.local", "burstrl.cli")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def imports() -> dict[str, set[str]]:
    """Module -> the burstrl modules it imports (`from pkg import sub` names `pkg.sub`)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            # a submodule always imports its parent packages: not an arrow
            out[name].update(t for t in targets if t in files and t != name and not name.startswith(t + "."))
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_arrows_between_packages_are_the_documented_ones() -> None:
    wrong = []
    for module, targets in sorted(imports().items()):
        source = package_of(module)
        for target in sorted(targets):
            dest = package_of(target)
            if dest == source:
                continue
            if dest not in FOUNDATIONS and (source in FOUNDATIONS or dest not in ALLOWED[source]):
                wrong.append(f"{module} -> {target}")
    assert not wrong, ("arrows not in docs/architecture.md's package map (if one is meant, add it there and "
                       f"to ALLOWED): {wrong}")


def test_protocol_imports_only_the_standard_library() -> None:
    """Every role imports `protocol`, so it must cost nothing: the standard library and itself only."""
    wrong = []
    for path in (PACKAGE / "protocol").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            wrong += [f"{path.name}: {n}" for n in names
                      if n.split(".")[0] not in sys.stdlib_module_names and not n.startswith("burstrl.protocol")]
    assert not wrong, wrong


def test_no_import_cycle_between_modules() -> None:
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, " -> ".join(cycle)


def test_light_roles_do_not_import_torch() -> None:
    """In a fresh interpreter, `import burstrl.router.server` (and the rest) leaves torch unloaded."""
    check = ("import importlib, sys\n"
             f"for name in {TORCH_FREE!r}:\n"
             "    importlib.import_module(name)\n"
             "    assert 'torch' not in sys.modules, name + ' imports torch'\n")
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(SRC)})
    assert r.returncode == 0, r.stderr[-2000:]
