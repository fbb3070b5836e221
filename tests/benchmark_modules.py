"""Import a benchmark script (`benchmarks/NAME.py`) as a module, to test the helpers only it uses.

Why: code that only a benchmark needs lives in that benchmark, not in the library; its tests load
the script by path (the benchmarks directory is not a package).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/{name}.py`, executed once (its `main()` is not run)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while it runs
    spec.loader.exec_module(module)
    return module
