"""Commit-only grading: take what the agent committed, grade it by the task's tests in a fresh sandbox.

Why commit-only: the attempt's sandbox is the agent's to mess up (stray files, half edits,
background processes); a commit is an explicit "this is my answer". So `extract_patch` takes
`git diff --binary BASE HEAD` (BASE: the export's commit id, never the movable tag) and nothing
else, and `grade` applies it to a fresh export of the task's base in a new sandbox (no network),
as SWE-bench does: the patch applied (failure = reward 0, recorded), the files that hold the graded
tests, those the test patch touches and every file that configures the test run reset to the base
(an edited test or a committed `conftest.py` proves nothing; `reset_files` lists what the patch
had touched), the test patch applied, the target (FAIL_TO_PASS) and existing (PASS_TO_PASS) tests
run, and per-test status read from the log and, for pytest, a JUnit report at an unguessable path,
cross-checked (`integrity` holds the rules and the threat model; a mismatch is `tampered`, reward 0).

Infra failures vs model failures: a result with `infra_error` set says nothing about the model
(the sandbox could not start or died, the task's test patch does not apply on its own base, the
test runner fails without the patch too). `grade` returns it instead of raising, so that a pool of
graders never loses a batch to one fault; the evaluator retries such attempts and must never
count them as model failures. Bad task input (a repository that cannot be exported) raises.
`reward_of` raises on an infra result.

The rule that keeps infra out of the model's reach: an outcome the patch could cause is only infra
when the same thing happens WITHOUT the patch. So when the tests with the patch run past the time
limit, or the runner runs no graded test at all (`No module named pytest`, a stale id, an import
the patch broke), the grader runs the tests at the base (empty patch, a fresh sandbox, cached per
task in this process). A timeout is the model's (`reason` = `tests_timeout: ...`, reward 0) when
the base run finishes within half the limit, infra otherwise (the task is too slow for its limit,
or the machine is). A runner error is the task's (`infra_error` = `task error: ...`) when the base
run errors too, a plain failure (reward 0) otherwise. A patch cannot make the base run slow or
broken: it runs in its own sandbox, without the patch.
The same rule for the test patch: when it does not apply after the model's patch (whose files
it touches were reset, so only a patch that puts a file where the test patch needs a directory
can do that), the base decides: `test_patch_blocked` (reward 0) if it applies there, a task error
if not. Test files that cannot be reset after the patch (a directory swapped for a symlink) are
`tampered`: a fresh repository always resets.
A sandbox that dies or stops answering while the tests run the model's patch (which can kill the
daemon or fill its memory) is the model's doing, not infra: `model_error` says so, the result
scores 0, and a trainer must not re-run it (a policy would learn to erase its failures that way).
"""

from __future__ import annotations

import hashlib
import io
import re
import shlex
import tarfile
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from burstrl.envs.swe.diffpolicy import DiffPolicy
from burstrl.envs.swe.integrity import GradingRun, harness_files, runner_error, verdict
from burstrl.envs.swe.repo import BASE_TAG, export_base
from burstrl.envs.swe.sandboxes import GradingSandbox, SandboxMaker
from burstrl.envs.swe.screen import GradeInfraError, policy_violation, refusal, scan_changes
from burstrl.envs.swe.seal import judge as judge_sealed
from burstrl.envs.swe.seal import seal_off
from burstrl.envs.swe.task import SweTask
from burstrl.envs.swe.testlog import EXPECTED, coarse, dotted_id, parse_junit_xml, status_of
from burstrl.envs.swe.testrun import (
    REPO_DIR,
    SCRATCH,
    cap_log,
    check,
    grading_command,
    read_report,
    run_tests,
    unique,
)
from burstrl.sandbox.backends import SandboxSpec, make_backend
from burstrl.sandbox.client import SandboxError

__all__ = ["GradeResult", "reward_of", "score", "grade", "extract_patch", "dotted_id", "parse_junit_xml",
           "status_of", "patch_paths", "graded_test_files", "grading_command"]

REWARD_KINDS = ("binary", "f2p", "strict")


@dataclass
class GradeResult:
    """One graded attempt; `parts()` is what the rollout store keeps next to the reward."""

    instance_id: str
    resolved: bool = False
    f2p: float = 0.0
    strict: float = 0.0
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_failed: int = 0
    p2p_total: int = 0
    apply_ok: bool = False
    apply_error: str = ""
    infra_error: str = ""  # non-empty: not a model outcome; retry, never score
    model_error: str = ""  # non-empty: the model's code broke the grading sandbox; scores 0
    reason: str = ""  # "kind: why" of a model failure with a name (tampered, tests_timeout, run_incomplete)
    tampered: str = ""  # non-empty: the results were forged (integrity) or the diff policy refused the patch; 0
    policy_rule: str = ""  # the diff policy's rule that refused the patch (diffpolicy.py), "" if none
    reset_files: list[str] = field(default_factory=list)  # paths the patch touched that were reset to the base
    suspicious: list[str] = field(default_factory=list)  # "path: rule" the patch adds (scan.py)
    sealed: bool = False  # the tests ran sealed (seal.py): results signed out of the code's reach
    seal_off: str = ""  # why the run was not sealed ("" when it was, or no test ran)
    runner_error: str = ""  # the runner ran no graded test; its own error
    test_patch_blocked: bool = False  # the test patch did not apply after the model's patch
    timed_out: bool = False
    test_seconds: float = 0.0  # the test command alone
    statuses: dict[str, str] = field(default_factory=dict)  # test id -> status, target + existing only
    log: str = ""
    duration_s: float = 0.0

    def parts(self) -> dict[str, Any]:
        return {"resolved": self.resolved, "f2p": self.f2p, "strict": self.strict, "apply_ok": self.apply_ok,
                "tampered": bool(self.tampered), "reset_files": len(self.reset_files)}

    def fail(self, reason: str) -> None:
        """A named model failure: reward 0 whatever the statuses said."""
        self.reason = reason
        self.resolved, self.f2p, self.strict, self.f2p_passed = False, 0.0, 0.0, 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def reward_of(result: GradeResult, kind: str = "binary") -> float:
    """The training reward: binary (resolved as 0/1, the default), f2p or strict (partial credit).

    Raises on an infra error: such an attempt has no reward, and scoring it 0 would teach the
    model that a crashed sandbox was its fault.
    """
    if result.infra_error:
        raise ValueError(f"{result.instance_id}: no reward for an infra failure ({result.infra_error})")
    if kind == "binary":
        return 1.0 if result.resolved else 0.0
    if kind == "f2p":
        return result.f2p
    if kind == "strict":
        return result.strict
    raise ValueError(f"unknown reward kind {kind!r}; expected one of {', '.join(REWARD_KINDS)}")


def score(result: GradeResult, task: SweTask, statuses: dict[str, str],
          expected: dict[str, str] | None = None) -> GradeResult:
    """Fill the scores from per-test statuses. A test id missing from the log counts as failed,
    and only "passed" passes (a skipped existing test has stopped proving anything); "xfailed" and
    "xpassed" pass only where `expected` (the gold patch's run) shows that same outcome: a plugin
    that marks every test xfail would otherwise turn every failure into a pass.

    With no target tests, "all target tests pass" holds vacuously (f2p = 1); `tasks check`
    flags such tasks.
    """
    def passed(tid: str) -> bool:
        s = status_of(statuses, tid)
        return s == "passed" or (s in EXPECTED and expected is not None and status_of(expected, tid) == s)

    f2p, p2p = unique(task.FAIL_TO_PASS), unique(task.PASS_TO_PASS)
    result.statuses = {tid: status_of(statuses, tid) for tid in f2p + p2p}
    result.f2p_total, result.p2p_total = len(f2p), len(p2p)
    result.f2p_passed = sum(passed(t) for t in f2p)
    result.p2p_failed = sum(not passed(t) for t in p2p)
    result.f2p = result.f2p_passed / len(f2p) if f2p else 1.0
    result.strict = result.f2p if result.p2p_failed == 0 else 0.0
    result.resolved = result.f2p_passed == len(f2p) and result.p2p_failed == 0
    return result


def extract_patch(sandbox: GradingSandbox, repo_dir: str = REPO_DIR, base: str = BASE_TAG) -> str:
    """Only what the agent committed: `git diff --binary BASE HEAD` inside its sandbox.

    Uncommitted and untracked work is not in that diff by construction. Options pin the format
    whatever the agent put in `.git/config` (colour, external diff, no prefixes, textconv).
    The diff goes through a file, not the exec output, which is capped. A repository the agent
    broke (no HEAD, .git removed) counts as nothing committed: "". Pass the base commit id
    from `export_base` as `base` to be immune to a moved tag.
    """
    out = f"{SCRATCH}/extract.patch"
    cmd = (f"mkdir -p {SCRATCH} && git -C {shlex.quote(repo_dir)} -c core.quotepath=off diff --binary "
           "--no-color --no-ext-diff --no-textconv --no-relative --src-prefix=a/ --dst-prefix=b/ "
           f"{shlex.quote(base)} HEAD -- > {out}")
    res = sandbox.exec(cmd, timeout=120)
    if res.exit_code != 0:
        return ""
    return sandbox.read_file(out).decode("utf-8", "surrogateescape")


def grade(task: SweTask, patch: str, pool_or_backend: SandboxMaker | str, *, timeout_s: float = 300,
          policy: DiffPolicy | None = None, gold: bool = False, suspicious: str = "flag",
          seal: bool = True) -> GradeResult:
    """Grade one attempt's patch in a fresh sandbox; see the module docstring for infra errors.

    `policy`: the task set's exceptions to the diff policy (merged with the task's own
    `extra.diff_policy`); a patch the policy refuses is `tampered` before any test runs.
    `gold`: this is the task's gold patch, whose xfail outcomes are by definition the expected ones;
    otherwise a graded test reported xfailed/xpassed passes only if the gold run (`gold_run`,
    once per task) shows the same. `suspicious`: "flag" records what the static scan (`scan.py`)
    finds in the changed code; "zero" (training) also scores such an attempt 0 without running it.
    `seal`: run the tests sealed where the command allows (`seal.py`); False runs every task
    unsealed, with the log, report and end-marker checks of `integrity` only."""
    if suspicious not in ("flag", "zero"):
        raise ValueError(f"suspicious must be 'flag' or 'zero', got {suspicious!r}")
    start = time.monotonic()
    policy = DiffPolicy.of(task.extra.get("diff_policy"), policy)
    result = GradeResult(instance_id=task.instance_id, seal_off="" if seal else "turned off by the grader's caller")
    base_id, repo_tar, base_files = base_tar(task)
    creator = _creator(pool_or_backend)
    try:
        sandbox = creator.create(_spec(task))
    except Exception as exc:  # could not start: not the model's doing
        result.infra_error = f"sandbox did not start: {exc!r}"
        return _done(result, start)
    try:
        _grade_in(sandbox, task, patch, (base_id, repo_tar, base_files), timeout_s, result, policy, gold, suspicious)
    except ModelCodeError as exc:  # the daemon died under the tests of the model's patch
        result.model_error = f"sandbox failed while running the tests: {exc.__cause__!r}"
    except (SandboxError, OSError, GradeInfraError) as exc:  # the sandbox died or stopped answering
        result.infra_error = f"sandbox failed while grading: {exc!r}"
    finally:
        sandbox.close()  # before any base run: a grader never holds two sandboxes of a bounded pool
    if result.test_patch_blocked and not base_run(task, creator, timeout_s).infra_error:  # applies without it
        result.infra_error = ""
        result.fail("test_patch_blocked: the patch keeps the task's test patch from applying")
    elif not (result.infra_error or result.model_error) and (result.timed_out or result.runner_error):
        _judge_against_base(task, patch, creator, timeout_s, result)
    if not gold and not (result.infra_error or result.model_error or result.reason) \
            and any(s in EXPECTED for s in result.statuses.values()):
        reference = gold_run(task, creator, timeout_s, policy)
        if reference.infra_error:
            result.infra_error = f"xfail outcomes need the gold run, which failed: {reference.infra_error}"
        else:
            score(result, task, result.statuses, reference.statuses)
    return _done(result, start)


def _judge_against_base(task: SweTask, patch: str, creator: SandboxMaker, timeout_s: float,
                        result: GradeResult) -> None:
    """A timeout or a runner error is the model's only if the tests run fine without its patch."""
    what = f"test command ran past {timeout_s:g}s" if result.timed_out else f"test runner error: {result.runner_error}"
    if not patch.strip():  # this run was the base run
        result.infra_error = f"task error: {what} without any patch" if result.runner_error else what
        return
    base = base_run(task, creator, timeout_s)
    if base.infra_error:
        result.infra_error = f"{what}; the run without the patch failed too: {base.infra_error}"
    elif result.timed_out and base.test_seconds > timeout_s / 2:
        result.infra_error = f"{what}; without the patch they take {base.test_seconds:.1f}s (over half the limit)"
    elif result.timed_out:
        result.fail(f"tests_timeout: with the patch the tests ran past {timeout_s:g}s; "
                    f"without it they finish in {base.test_seconds:.1f}s")
    # a runner error with a base that runs: the patch broke the run; a plain failure, scored as is


_BASE_RUNS: OrderedDict[tuple[str, ...], GradeResult] = OrderedDict()


def gold_run(task: SweTask, creator: SandboxMaker, timeout_s: float, policy: DiffPolicy | None = None) -> GradeResult:
    """The task's gold patch graded, once per task in this process (kept beside the base runs):
    its xfailed/xpassed outcomes are the only ones an attempt's may match."""
    return _run_once(("gold", hashlib.sha256(task.patch.encode()).hexdigest(), *_task_key(task)),
                     lambda: grade(task, task.patch, creator, timeout_s=timeout_s, policy=policy, gold=True),
                     lambda r: not r.infra_error)


def base_run(task: SweTask, creator: SandboxMaker, timeout_s: float) -> GradeResult:
    """The task's tests without any patch (a fresh sandbox), measured once per task in this process.

    Only runs that say something about the task are kept (not one whose sandbox failed)."""
    return _run_once(_task_key(task),
                     lambda: grade(task, "", creator, timeout_s=timeout_s),  # an empty patch: no policy applies
                     lambda r: not r.infra_error or r.infra_error.startswith("task error"))


def _task_key(task: SweTask) -> tuple[str, ...]:
    return (task.repo, task.base_commit, task.test_cmd, hashlib.sha256(task.test_patch.encode()).hexdigest(),
            *unique(task.FAIL_TO_PASS + task.PASS_TO_PASS))


def _run_once(key: tuple[str, ...], run: Callable[[], GradeResult],
              keep: Callable[[GradeResult], bool]) -> GradeResult:
    """`run()`'s result, cached under `key` (the last 64 kept) when `keep` says it is about the task."""
    with _base_lock:
        if key in _BASE_RUNS:
            return _BASE_RUNS[key]
    result = run()
    if keep(result):
        with _base_lock:
            _BASE_RUNS[key] = result
            while len(_BASE_RUNS) > 64:
                _BASE_RUNS.popitem(last=False)
    return result


def _grade_in(sandbox: GradingSandbox, task: SweTask, patch: str, base: tuple[str, bytes, frozenset[str]],
              timeout_s: float, result: GradeResult, policy: DiffPolicy, gold: bool = False,
              suspicious: str = "flag") -> None:
    base_id, repo_tar, base_files = base
    sandbox.upload(repo_tar, REPO_DIR)
    check(sandbox.exec(f"mkdir -p {SCRATCH} && git reset -q --hard {base_id}", cwd=REPO_DIR, timeout=120),
           "reset to the base")
    tests = graded_test_files(task, base_files)
    violation = policy_violation(sandbox, patch, base_files, tests, policy)
    if violation is not None:  # before the patch touches the tree: nothing of it ever runs
        result.tampered, result.policy_rule = str(violation), violation.rule
        result.fail(f"tampered: {result.tampered}")
        return
    result.apply_ok, result.apply_error = apply_in(sandbox, patch, "model.patch")
    if not result.apply_ok:
        return  # reward 0, nothing to run
    touched = patch_paths(patch)
    harness = harness_files(touched, tests, [p for p in touched if p not in base_files])
    protected = tests + patch_paths(task.test_patch) + harness
    result.reset_files = [p for p in touched if p in protected]
    try:
        reset_paths(sandbox, protected, base_id)
    except GradeInfraError as exc:  # a fresh repo resets; only the patch (symlinks, dirs) can stop it
        result.tampered = f"the test files could not be reset after the patch: {exc}"
        result.fail(f"tampered: {result.tampered}")
        return
    found = scan_changes(sandbox, [p for p in touched if p not in protected], repo_tar, REPO_DIR, tests)
    violation, result.suspicious = refusal(found, policy)
    if violation is not None:  # introspection, lying values, ... no fix needs: refused in every mode
        result.tampered, result.policy_rule = str(violation), violation.rule
        result.fail(f"tampered: {result.tampered}")
        return
    if result.suspicious and suspicious == "zero":  # training: a forgery's primitives score 0, untested
        result.fail(f"suspicious: {', '.join(result.suspicious[:5])}")
        return
    if task.test_patch.strip():
        ok, msg = apply_in(sandbox, task.test_patch, "test.patch")
        if not ok:  # the task's fault only if it fails without the patch too (`_judge_against_base`)
            result.infra_error = f"task error: test_patch does not apply on the base: {msg}"
            result.test_patch_blocked = bool(patch.strip())
            return
    changed = [p for p in touched if p not in protected]
    result.seal_off = result.seal_off or seal_off(task.test_cmd, changed, base_files)
    try:
        sources = [p for p in unique(tests + patch_paths(task.test_patch)) if p.endswith(".py")]
        run = run_tests(sandbox, task, timeout_s, None if result.seal_off else changed, sources)
        report = read_report(sandbox, run["report"])
    except (SandboxError, OSError) as exc:
        raise ModelCodeError() from exc
    result.log, result.test_seconds = cap_log(run["text"]), run["seconds"]
    judge_run(task, run, report, result, gold)


def judge_run(task: SweTask, run: GradingRun, report: dict[str, str] | None, result: GradeResult,
              gold: bool = False) -> None:
    """Scores from one run's log and report, with the integrity checks of `integrity.verdict`
    (xfail outcomes not yet credited unless this is the gold run: `grade` asks the gold run)."""
    graded = unique(task.FAIL_TO_PASS + task.PASS_TO_PASS)
    sealed, exit_code = run.get("seal") is not None or not result.seal_off, run["exit_code"]
    if sealed:
        statuses, tampered, finished = judge_sealed(run.get("seal"), graded)
        result.sealed = bool((run.get("seal") or {}).get("hook"))
        exit_code = (run.get("seal") or {}).get("returncode")
        exit_code = 1 if exit_code is None else int(exit_code)  # no verdict: the collector was killed
    else:
        statuses, tampered, finished = verdict(task.test_cmd, run, report, graded)
    score(result, task, statuses, statuses if gold else None)
    if run["timed_out"]:
        result.timed_out = True  # partial statuses kept; the base run decides (`_judge_against_base`)
        result.fail("")
    elif tampered:
        result.tampered = tampered
        result.fail(f"tampered: {tampered}")
    elif sealed and not finished and any(s != "missing" for s in statuses.values()):  # ended mid-run
        result.fail(f"run_incomplete: the test process ended (exit {exit_code}) before the runner "
                    "returned; nothing it reported is credited")
    elif not finished and any(coarse(s) == "passed" for s in result.statuses.values()):
        result.fail(f"run_incomplete: the runner exited {run['exit_code']} without its final summary, "
                    "report or end marker; nothing it printed is credited")
    else:
        result.runner_error = runner_error(run["text"], exit_code, statuses, graded)


def apply_in(sandbox: GradingSandbox, patch: str, name: str) -> tuple[bool, str]:
    """`git apply` a patch inside the sandbox's repo; an empty patch applies trivially."""
    if not patch.strip():
        return True, ""
    path = f"{SCRATCH}/{name}"
    if not patch.endswith("\n"):  # a diff cut at its last newline still applies
        patch += "\n"
    try:
        sandbox.write_file(path, patch.encode("utf-8", "surrogateescape"))
    except SandboxError as exc:  # refused (over the daemon's body limit), the daemon alive: the patch's size
        if not 400 <= exc.status < 500:
            raise
        return False, f"the patch could not be written into the grading sandbox: {exc}"
    res = sandbox.exec(f"git apply --binary --whitespace=nowarn {path}", cwd=REPO_DIR, timeout=120)
    if res.exit_code == 0:
        return True, ""
    return False, (res.stderr or res.stdout).strip()[-4000:] or f"git apply exited {res.exit_code}"


def patch_paths(patch: str) -> list[str]:
    """Every path a git diff touches, old and new names (from `---`/`+++` and rename headers)."""
    paths: list[str] = []
    for line in patch.splitlines():
        m = re.match(r"^(?:--- a/|\+\+\+ b/|rename from |rename to |copy to )(.+?)\t?$", line)
        if m is None:
            m = re.match(r"^diff --git a/(.+) b/\1$", line)  # mode-only and binary changes
        if m is not None and m.group(1) not in paths:
            paths.append(m.group(1))
    return paths


def graded_test_files(task: SweTask, base_files: frozenset[str]) -> list[str]:
    """The base's files that define the graded tests, found from the test ids.

    Why: where the tests live in the repository (toy tasks, SWE-smith), an agent could "fix" a
    target test by editing it; the grader runs the task's tests, so these files are reset to the
    base before the tests run, as SWE-bench resets the test patch's files. pytest ids name their
    file (`path.py::...`); a unittest id `a.b.C.test` is matched to `a/b/C.py`, `a/b.py`, ...
    """
    found: list[str] = []
    for tid in unique(task.FAIL_TO_PASS + task.PASS_TO_PASS):
        if "::" in tid:
            candidates = [tid.split("::", 1)[0]]
        else:
            parts = tid.split("[", 1)[0].split(".")
            candidates = ["/".join(parts[:i]) + ".py" for i in range(len(parts), 0, -1)]
        hit = next((c for c in candidates if c in base_files), None)
        if hit is not None and hit not in found:
            found.append(hit)
    return found


def reset_paths(sandbox: GradingSandbox, paths: Sequence[str], base_id: str) -> None:
    """Put `paths` back as they are at the base (removed if the base lacks them), so the test
    patch lands on exactly the files it was made against whatever the model patch did to them."""
    if not paths:
        return
    quoted = " ".join(shlex.quote(p) for p in unique(paths))
    cmd = (f'for f in {quoted}; do if git cat-file -e {base_id}:"$f" 2>/dev/null; '
           f'then git checkout -q {base_id} -- "$f"; else rm -rf -- "$f"; fi || exit 1; done')
    check(sandbox.exec(cmd, cwd=REPO_DIR, timeout=120), "reset the test patch's files")


_BASE_CACHE: OrderedDict[tuple[str, str], tuple[str, bytes, frozenset[str]]] = OrderedDict()
_BASE_CACHE_SIZE = 4
_base_lock = threading.Lock()


def base_tar(task: SweTask) -> tuple[str, bytes, frozenset[str]]:
    """The task's base, exported (no history) and kept as tar bytes for the next attempts at
    the same task: graders take K attempts per task in a row, and an export costs git work.
    Returns (base commit id in the export, tar bytes, the base's file paths). Exports run one at a time (lock): the
    cache would otherwise miss for K graders starting together."""
    key = (task.repo, task.base_commit)
    with _base_lock:
        if key in _BASE_CACHE:
            _BASE_CACHE.move_to_end(key)
            return _BASE_CACHE[key]
        with tempfile.TemporaryDirectory(prefix="burstrl-grade-") as tmp:
            base_id = export_base(task, Path(tmp) / "repo")
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(Path(tmp) / "repo", arcname=".")
                names = frozenset(m.name.removeprefix("./") for m in tar.getmembers() if m.isfile())
        _BASE_CACHE[key] = (base_id, buf.getvalue(), names)
        while len(_BASE_CACHE) > _BASE_CACHE_SIZE:
            _BASE_CACHE.popitem(last=False)
        return _BASE_CACHE[key]


def _creator(pool_or_backend: SandboxMaker | str) -> SandboxMaker:
    """A SandboxPool or a backend (both have `create(spec)`), or a backend's name."""
    return make_backend(pool_or_backend) if isinstance(pool_or_backend, str) else pool_or_backend


def _spec(task: SweTask) -> SandboxSpec:
    return SandboxSpec(image=Path(task.image) if task.image else None, cpu_limit=task.cpu,
                       memory_limit_mb=task.memory, workdir_mb=task.disk)


class ModelCodeError(RuntimeError):
    """The sandbox failed while it ran the model's patch (its tests): the model's doing (the cause)."""


def _done(result: GradeResult, start: float) -> GradeResult:
    result.duration_s = round(time.monotonic() - start, 3)
    return result
