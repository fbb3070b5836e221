"""Grading one functions attempt: the candidate runs in a sandbox that holds neither the tests nor
the expected values; plain data comes back; the comparison happens here, in the grader's process.

Why not the SWE grader: that runs the hidden tests in the candidate's own process, where anything
the candidate does (an object whose `__eq__` is always True, a runner-internal exception, reading
the test file or the caller's frame, patching the assertion, forging the result channel) can turn
a wrong answer into a pass; each such route is a class of hacks, not a case. Here none of them has
anything to act on: the sandbox receives only the candidate's module (the stub with the
completion), `runner.py`, `plaindata.py` and the ARGUMENTS of each case (inputs are not secret);
never the task repository, which holds every task's tests. The runner calls the function once per
case in a forked child and sends back, per case, an exact-type plain value, an exception's type
name, or why there is none (timeout, exit, signal, not plain data). `read_results` decodes those
lines strictly and bounded (`plaindata`): malformed, oversized, too deep, duplicated or missing
lines fail their cases, never the grader. A value case passes iff `expected == got` on real
builtins (what unittest's assertEqual does for such values); an exception case iff the reported
type name is the expected one.

The channel needs no integrity inside the sandbox: the whole sandbox is the candidate's, so
whatever its code does to the runner (rewrite the encoder, print lines of its own, kill or stop
the runner) yields only plain data it could have returned honestly, or nothing. The grade is a
function of those values and of expected values the sandbox never held.

Infra failures vs model failures, the SWE grader's rule (`envs/swe/grade.py`): a sandbox that could
not start, or failed while the job was uploaded, is `infra_error` (re-run, never scored). Anything
the candidate's code could cause is its 0: a case past its time, an exit, a dead daemon
(`model_error`). Only when the whole run ends without an answer (past the attempt's limit, or no
line at all) does the grader run the task's stub the same way (once per task in this process): the
candidate's 0 when the stub runs fine (within half the limit), infra otherwise.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from burstrl.envs.functions import plaindata
from burstrl.envs.functions.cases import Case, task_cases
from burstrl.envs.swe.sandboxes import GradingSandbox, SandboxMaker
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.backends import SandboxSpec, make_backend
from burstrl.sandbox.client import SandboxError

JOB_DIR = "/work/job"
HERE = Path(__file__).parent
RUNNER_FILES = ("runner.py", "plaindata.py")
PYTHON = ["python3", "-E", "-s", "-B"]  # no PYTHON* variables, no user site, no bytecode files
LINE_LIMIT = plaindata.MAX_BYTES + 64  # "[INDEX," + a child's entry + "]"
SYNTAX = ("SyntaxError", "IndentationError", "TabError")
GRADE_TIMEOUT_S = 60.0  # one attempt's limit in training unless configured (`FunctionsOptions.grade_timeout_s`)


@dataclass
class FunctionResult:
    """One graded attempt. `statuses`: case id -> passed, failed (another value or exception),
    error (raised where a value was expected), timeout, crashed (exit or signal), invalid (not
    plain data, malformed), missing (no result)."""

    instance_id: str
    resolved: bool = False
    f2p: float = 0.0
    passed: int = 0
    total: int = 0
    statuses: dict[str, str] = field(default_factory=dict)
    import_error: str = ""  # the exception's type name when the module did not import
    reason: str = ""  # "kind: why" of a named model failure (tests_timeout, runner_lost)
    infra_error: str = ""  # non-empty: not a model outcome; retry, never score
    model_error: str = ""  # non-empty: the candidate's code broke the sandbox; scores 0
    timed_out: bool = False  # the whole run ran past the limit
    run_seconds: float = 0.0
    duration_s: float = 0.0
    log: str = ""  # the runner's own stderr (its errors; the candidate's output goes nowhere)

    def fail(self, reason: str) -> None:
        """A named model failure: reward 0 whatever the cases said."""
        self.reason, self.resolved, self.f2p, self.passed = reason, False, 0.0, 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def grade(task: SweTask, source: str, pool_or_backend: SandboxMaker | str, *,
          timeout_s: float = GRADE_TIMEOUT_S) -> FunctionResult:
    """Grade the module text `source` (the task's stub with the candidate's body) against the task's
    cases, in a fresh sandbox. TaskError for a task without cases (an older set)."""
    start = time.monotonic()
    cases = task_cases(task)
    result = FunctionResult(task.instance_id, total=len(cases))
    out = run_job(task, source, cases, pool_or_backend, timeout_s, result)
    if out is not None:
        judge(task, cases, out, result, pool_or_backend, timeout_s)
    result.duration_s = round(time.monotonic() - start, 3)
    return result


def run_job(task: SweTask, source: str, cases: list[Case], pool_or_backend: SandboxMaker | str, timeout_s: float,
            result: FunctionResult) -> str | None:
    """The runner's result lines, or None with `infra_error` / `model_error` set."""
    maker = make_backend(pool_or_backend) if isinstance(pool_or_backend, str) else pool_or_backend
    try:
        sandbox = maker.create(SandboxSpec(image=Path(task.image) if task.image else None, cpu_limit=task.cpu,
                                           memory_limit_mb=task.memory, workdir_mb=task.disk))
    except Exception as exc:  # could not start: not the model's doing
        result.infra_error = f"sandbox did not start: {exc!r}"
        return None
    try:
        try:
            for name, data in job_files(task, source, cases, timeout_s).items():
                sandbox.write_file(f"{JOB_DIR}/{name}", data)
        except (SandboxError, OSError) as exc:  # nothing of the candidate ran yet
            result.infra_error = f"sandbox failed while the job was uploaded: {exc!r}"
            return None
        return _exec(sandbox, timeout_s, result)
    finally:
        sandbox.close()


def _exec(sandbox: GradingSandbox, timeout_s: float, result: FunctionResult) -> str | None:
    """The runner's result lines (read back from its file; "" if none), or None with `model_error` set."""
    start = time.monotonic()
    try:
        res = sandbox.exec([*PYTHON, f"{JOB_DIR}/runner.py", JOB_DIR], timeout=timeout_s, cwd=JOB_DIR)
        result.run_seconds = round(time.monotonic() - start, 3)
        result.timed_out, result.log = bool(res.timed_out), (res.stderr or res.stdout)[-4000:]
        return sandbox.read_file(f"{JOB_DIR}/results").decode("utf-8", "replace")
    except SandboxError as exc:
        if 400 <= exc.status < 500:  # no results file, or one over the read limit: no answer (`judge`)
            return ""
        result.model_error = f"sandbox failed while the candidate ran: {exc!r}"
    except OSError as exc:  # the daemon died or stopped answering under the candidate's code
        result.model_error = f"sandbox failed while the candidate ran: {exc!r}"
    return None


def job_files(task: SweTask, source: str, cases: list[Case], timeout_s: float) -> dict[str, bytes]:
    """What the sandbox receives: the runner, the codec, the module, the arguments. Nothing else."""
    module = module_file(task)
    job = {"module": module, "function": function_name(task), "case_timeout_s": case_timeout(timeout_s, len(cases)),
           "cases": [plaindata.dumps(c.args) for c in cases]}
    files = {name: (HERE / name).read_bytes() for name in RUNNER_FILES}
    files["job.json"] = json.dumps(job).encode()
    files[module] = source.encode("utf-8", "surrogateescape")
    return files


def case_timeout(timeout_s: float, n: int) -> float:
    """Each case's share of the attempt's limit: all of them at their limit end within half of it."""
    return round(timeout_s / (2 * (n + 1)), 3)


def module_file(task: SweTask) -> str:
    name = Path(str(task.extra.get("file") or "solution.py")).name
    return name if name.endswith(".py") and name.isascii() and name[:-3].isidentifier() else "solution.py"


def function_name(task: SweTask) -> str:
    """The function's name: `extra.function`, else the prompt's def line."""
    name = task.extra.get("function") or str(task.extra.get("prompt", "")).split("def ", 1)[-1].split("(", 1)[0]
    if not str(name).isidentifier():
        raise ValueError(f"task {task.instance_id}: no function name in extra.function or the prompt's def line")
    return str(name)


def read_results(text: str, n: int) -> tuple[str, list[list[Any] | None]]:
    """(the import error's type name or "", one entry per case or None) from the runner's result lines:
    strict, bounded, never raises; more lines than the runner writes fail every case.
    An entry: ["ok", value] (value decoded), ["raise", name], ["timeout"], ["crashed", why], ["invalid", why]."""
    entries: list[list[Any] | None] = [None] * n
    seen: dict[int, int] = {}
    import_error = ""
    if text.count("\n") > n + 1:  # the runner writes one line per case: the rest came from elsewhere
        return "", [["invalid", "more result lines than cases"]] * n
    for line in text.split("\n"):
        if not line.startswith("[") or len(line) > LINE_LIMIT:
            continue
        try:
            tree = plaindata.parse_json(line, LINE_LIMIT)
        except plaindata.PlainDataError:
            continue
        if type(tree) is not list or len(tree) != 2:
            continue
        key, raw = tree
        if key == "import" and _is_raise(raw):
            import_error = raw[1]
        elif type(key) is int and 0 <= key < n:
            seen[key] = seen.get(key, 0) + 1
            entries[key] = _entry(raw)
    for key, count in seen.items():
        if count > 1:  # two answers for one call: neither is the call's
            entries[key] = ["invalid", "more than one result"]
    return import_error, entries


def _entry(raw: Any) -> list[Any]:
    if type(raw) is not list or not raw or type(raw[0]) is not str:
        return ["invalid", "malformed result"]
    kind = raw[0]
    if kind == "ok" and len(raw) == 2:
        try:
            return ["ok", plaindata.decode(raw[1])]
        except plaindata.PlainDataError as exc:
            return ["invalid", str(exc)[:200]]
    if _is_raise(raw):
        return raw
    if kind == "timeout" and len(raw) == 1:
        return ["timeout"]
    if kind in ("exit", "signal") and len(raw) == 2 and type(raw[1]) is int:
        return ["crashed", f"{kind} {raw[1]}"]
    if kind == "invalid" and len(raw) == 2 and type(raw[1]) is str:
        return ["invalid", raw[1][:200]]
    return ["invalid", "malformed result"]


def _is_raise(raw: Any) -> bool:
    return type(raw) is list and len(raw) == 2 and raw[0] == "raise" and type(raw[1]) is str and len(raw[1]) <= 100


def case_status(case: Case, entry: list[Any] | None) -> str:
    """passed, failed, error, timeout, crashed, invalid or missing (see `FunctionResult`)."""
    if entry is None:
        return "missing"
    kind = entry[0]
    if kind == "ok":
        if case.raises:
            return "failed"
        return "passed" if _equal(case.returns, entry[1]) else "failed"
    if kind == "raise":
        if case.raises:
            return "passed" if entry[1] == case.raises else "failed"
        return "error"
    return kind if kind in ("timeout", "crashed", "invalid") else "invalid"


def _equal(expected: Any, got: Any) -> bool:
    """`==` of two plain values (both decoded builtins: bounded, no code of the candidate's)."""
    try:
        return bool(expected == got)
    except RecursionError:
        return False


def judge(task: SweTask, cases: list[Case], text: str, result: FunctionResult, maker: SandboxMaker | str,
          timeout_s: float) -> None:
    """Statuses and scores from the runner's lines; a run with no answer is judged against the stub's."""
    entries = score(result, cases, text)
    if result.timed_out or not (result.import_error or any(e is not None for e in entries)):
        _judge_against_stub(task, result, maker, timeout_s)


def score(result: FunctionResult, cases: list[Case], text: str) -> list[list[Any] | None]:
    """Fill `result` from the runner's result lines (a module that did not import errs every case);
    the decoded entries."""
    result.import_error, entries = read_results(text, len(cases))
    result.statuses = {c.id: "error" if result.import_error else case_status(c, e)
                       for c, e in zip(cases, entries, strict=True)}
    result.passed = sum(s == "passed" for s in result.statuses.values())
    result.f2p, result.resolved = result.passed / len(cases), result.passed == len(cases)
    return entries


def _judge_against_stub(task: SweTask, result: FunctionResult, maker: SandboxMaker | str, timeout_s: float) -> None:
    what = f"the run passed {timeout_s:g}s" if result.timed_out else "the runner gave no result at all"
    stub = stub_run(task, maker, timeout_s)
    if stub.infra_error:
        result.infra_error = f"{what}; the task's stub could not be run either: {stub.infra_error}"
    elif stub.timed_out or stub.run_seconds > timeout_s / 2:
        result.infra_error = f"{what}; the task's stub takes {stub.run_seconds:.1f}s (over half the limit)"
    elif not any(s != "missing" for s in stub.statuses.values()) and not stub.import_error:
        result.infra_error = f"task error: {what}, and none for the task's stub either: {stub.log[-300:]}"
    elif result.timed_out:
        result.fail(f"tests_timeout: the candidate's run passed {timeout_s:g}s; the stub's ends in "
                    f"{stub.run_seconds:.1f}s")
        result.statuses = {k: "timeout" if s == "missing" else s for k, s in result.statuses.items()}
    else:
        result.fail("runner_lost: no result came back (the candidate's code ended the runner or took its results "
                    "file), where the task's stub runs and answers")


_STUB_RUNS: OrderedDict[tuple[str, float], FunctionResult] = OrderedDict()
_stub_lock = threading.Lock()


def stub_run(task: SweTask, maker: SandboxMaker | str, timeout_s: float) -> FunctionResult:
    """The task's stub graded the same way, once per task in this process (the last 64 kept)."""
    cases = task_cases(task)
    job = job_files(task, stub_source(task), cases, timeout_s)
    key = (hashlib.sha256(job["job.json"] + job[module_file(task)] + task.image.encode()).hexdigest(), timeout_s)
    with _stub_lock:
        if key in _STUB_RUNS:
            return _STUB_RUNS[key]
    result = FunctionResult(task.instance_id, total=len(cases))
    out = run_job(task, stub_source(task), cases, maker, timeout_s, result)
    if out is not None:
        score(result, cases, out)
    if not result.infra_error:
        with _stub_lock:
            _STUB_RUNS[key] = result
            while len(_STUB_RUNS) > 64:
                _STUB_RUNS.popitem(last=False)
    return result


def stub_source(task: SweTask) -> str:
    """The module before any attempt: the prompt, then `raise NotImplementedError`."""
    return f"{task.extra['prompt']}    raise NotImplementedError\n"


def reward(result: FunctionResult) -> float:
    """The share of cases passed; ValueError for an infra result (it has no reward)."""
    if result.infra_error:
        raise ValueError(f"{result.instance_id}: no reward for an infra failure ({result.infra_error})")
    return 0.0 if result.model_error or result.reason else result.f2p
