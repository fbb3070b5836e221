"""burstrl's sealed test run: the bootstrap the grader copies into a fresh random directory of the
grading sandbox and runs as `python3 DIR/seal.py DIR LOG pytest|unittest ARGS...` in place of
`python3 -m pytest|unittest ARGS...` (see `seal.py` for the grader's side and what the seal covers).

Standalone on purpose: it runs on the task's own Python (3.8+ for the audit hook), imports nothing of
burstrl, and must be loaded before any repository code. Two processes:

- the collector (this process) makes a pipe and a 256-bit key, forks the test process, reads
  HMAC-signed messages from the pipe as the tests run, and when the test process is gone prints one
  verdict line on its own stdout, which nothing else in the sandbox holds (the test process and
  everything it starts write to LOG); it is made non-dumpable, so no process of the same user can
  read its memory or reopen its fds through /proc;
- the test process installs a CPython audit hook (PEP 578: it cannot be removed; `sealhook.py`)
  before it imports the runner, then runs the runner with a reporting plugin (pytest) or result
  class (unittest). The key and the pipe live only in the hook's closure, which nothing in Python
  can reach: the plugin hands each result to the hook with `sys.audit`; the hook checks who sent it,
  that the result is one the runner's own protocol made for that test, that the test's code is the
  repository's and the runner unchanged since the freeze before the first test (`sealtrust.py`),
  signs it and writes it. The hook also watches the primitives a forgery needs (frames, heap walks,
  ctypes memory access, the seal's files, the graded tests' sources, the process's /proc entries,
  code swaps, code claiming a trusted file, bytecode written at run time, trace hooks, more audit
  hooks); when code the patch brought uses one, the hook sends a signed `tamper` message and ends the
  process at once (the primitive never returns). After the runner returns the end message goes out
  and the process `os._exit`s: exit handlers never run after the results are in.

Trusted code (`sealtrust.py`): what the task's image provides (the interpreter's install and the
`sys.path` entries present at the start, for files older than the run), frozen modules, the seal's
own files, and the repository's files that the patch did not change, unchanged since the start.
Everything else is the patch's: its files, files written at run time, code compiled from strings.
The grader writes this file as DIR/seal.py beside `sealhook.py` and `sealtrust.py`.
"""

import hashlib
import hmac
import json
import os
import select
import struct
import sys

TAG = "burstrl-seal "  # prefix of the verdict line on the collector's stdout
MAX_MESSAGE = 1 << 20
SEVERITY = {"error": 4, "failed": 3, "skipped": 2, "xfailed": 2, "xpassed": 1, "passed": 0}


# ---- the collector ----

def main():
    rdir, log, runner, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    changed, graded = _take_list(rdir, "changed"), _take_list(rdir, "graded")
    tests = _take_list(rdir, "tests")
    t0 = _start_marker(rdir)
    _nondumpable()  # before the fork: the test process inherits it
    names = frozenset(t.split("[", 1)[0].replace("::", ".").rsplit(".", 1)[-1] for t in graded)
    pid, r, key = _start(log, runner, args, (changed, rdir, log, t0, tests, names))
    verdict = collect(r, pid, key)
    if graded:  # the verdict line stays small however many tests the run reports
        verdict["statuses"] = {k: v for k, v in verdict["statuses"].items() if k in graded}
    sys.stdout.write(TAG + json.dumps(verdict, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


def _take_list(rdir, name):
    """The lines of the grader's file `name` in the seal's directory (removed once read); [] if none."""
    path = os.path.join(rdir, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line]
    os.unlink(path)
    return lines


def _start_marker(rdir):
    """The ctime (ns) of a file made now: anything written after it has a ctime at least as late
    (the same coarse clock), so it tells files of the run from files of the image."""
    path = os.path.join(rdir, "t0")
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return os.fstat(fd).st_ctime_ns
    finally:
        os.close(fd)


def _start(log, runner, args, seal_args):
    """Fork the test process; in the parent (pid, read end, key). No frame of the test process
    keeps the key: it moves into the hook's closure and out of every local."""
    key = os.urandom(32)
    r, w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        box = [key]
        del key
        _test_process(box, w, log, runner, args, seal_args)  # never returns
    os.close(w)
    return pid, r, key


def collect(r, pid, key):
    """Read signed messages until the test process has exited (then what is left in the pipe);
    a message the hook did not sign, out of order or from another process makes the run tampered."""
    verdict = {"statuses": {}, "tampered": [], "complete": False, "exit": None, "hook": False, "messages": 0,
               "returncode": None}
    buf, seq, exited = b"", 0, False
    while True:
        if select.select([r], [], [], 0.25)[0]:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            buf += chunk
            buf, seq = _parse(buf, seq, pid, key, verdict)
        elif exited:
            break
        if not exited:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == pid:  # drain what is there without waiting for descendants that kept the pipe
                exited, verdict["returncode"] = True, _returncode(status)
    if buf and not verdict["tampered"]:
        verdict["tampered"].append("forged_message: bytes on the sealed channel that are not a signed message")
    if exited is False:
        try:
            verdict["returncode"] = _returncode(os.waitpid(pid, 0)[1])
        except ChildProcessError:
            pass
    return verdict


def _returncode(status):
    """As subprocess has it: the exit code, or minus the signal that killed the process."""
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


def _parse(buf, seq, pid, key, verdict):
    while len(buf) >= 36:
        size = struct.unpack(">I", buf[:4])[0]
        if size > MAX_MESSAGE:
            verdict["tampered"].append("forged_message: an oversized frame on the sealed channel")
            return b"", seq
        if len(buf) < 36 + size:
            break
        mac, body, buf = buf[4:36], buf[36:36 + size], buf[36 + size:]
        if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
            verdict["tampered"].append("forged_message: a message on the sealed channel the seal did not sign")
            return b"", seq
        msg = json.loads(body.decode())
        if msg.get("n") != seq or msg.get("pid") != pid:
            verdict["tampered"].append("forged_message: a signed message replayed, out of order or from "
                                       "another process (pid %s, #%s)" % (msg.get("pid"), msg.get("n")))
            return b"", seq
        seq += 1
        verdict["messages"] = seq
        _apply(msg, verdict)
    return buf, seq


def _apply(msg, verdict):
    kind = msg.get("k")
    if kind == "start":
        verdict["hook"] = bool(msg.get("hook"))
    elif kind == "tamper":
        verdict["tampered"].append(msg["why"])
    elif kind == "end":
        verdict["complete"], verdict["exit"] = True, msg.get("exit")
    elif kind == "report":
        status = _status(msg)
        if msg.get("when") == "call" and msg.get("outcome") == "passed" and msg.get("raised"):
            verdict["tampered"].append("raised_but_passed: %s raised in its call but was reported passed" % msg["id"])
        statuses = verdict["statuses"]
        old = statuses.get(msg["id"])
        if status is not None and (old is None or SEVERITY[status] > SEVERITY[old]):
            statuses[msg["id"]] = status


def _status(msg):
    """One report's status (pytest: per phase; only the call phase can pass), None if it says nothing."""
    if "status" in msg:  # unittest
        return msg["status"] if msg["status"] in SEVERITY else "error"
    when, outcome, xfail = msg.get("when"), msg.get("outcome"), msg.get("xfail")
    if outcome == "failed":
        return "failed" if when == "call" else "error"
    if outcome == "skipped":
        return "xfailed" if xfail else "skipped"
    if outcome == "passed" and when == "call":
        return "xpassed" if xfail else "passed"
    return None


def _nondumpable():
    """prctl(PR_SET_DUMPABLE, 0): /proc/PID/{mem,fd,...} of this process closed to other processes."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


# ---- the test process ----

def _test_process(box, w, log, runner, args, seal_args):
    code = 70
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for name in [m for m in sys.modules if m.split(".", 1)[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]  # the patch's own `import ctypes` must reach the hook
        sys.argv = ["python -m " + runner] + list(args)
        send = _install(box.pop(), w, seal_args)
        sys.path[0] = os.getcwd()  # as `python -m` has it: the working directory first
        code = _run(runner, list(args), send)
    except SystemExit as exc:  # as the interpreter ends on it (argparse's usage errors: 2)
        code = exc.code if isinstance(exc.code, int) else 1
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write("%s\n" % (exc.code,))
    except BaseException:  # as `python -m` would: the traceback in the log, exit 1, no end message
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _install(key, wfd, seal_args):
    """The audit hook (`sealhook.install`, the key's only holder) and the function reporting code
    sends with. Without audit hooks (Python < 3.8) the signed channel alone, and the verdict says so."""
    changed, rdir, log, t0, tests, graded_names = seal_args
    if hasattr(sys, "addaudithook"):
        import sealhook  # beside this file: sys.path[0] is still the seal's directory

        sys.path[0] = os.getcwd()  # the trust rule's roots: the path the tests will run with
        sealhook.install(key, wfd, (changed, rdir, log, t0, tests, graded_names), _allow.__code__)
        return sealhook.send
    return _unhooked_sender(key, wfd)


def _unhooked_sender(key, wfd):
    """Python < 3.8: results signed as the runner reports them, nothing watched (`hook: false`)."""
    state = {"n": 0}

    def emit(msg):
        msg.update(n=state["n"], pid=os.getpid())
        body = json.dumps(msg, sort_keys=True).encode()
        frame = struct.pack(">I", len(body)) + hmac.new(key, body, hashlib.sha256).digest() + body
        while frame:
            frame = frame[os.write(wfd, frame):]
        state["n"] += 1

    def send(kind, obj):
        if kind == "report" and isinstance(obj, tuple):
            emit({"k": kind, "id": str(obj[0].id()), "status": obj[1]})
        elif kind == "report":
            emit({"k": kind, "id": obj.nodeid, "when": obj.when, "outcome": obj.outcome,
                  "xfail": hasattr(obj, "wasxfail"), "raised": None})
        elif kind == "end":
            emit({"k": kind, "exit": obj})

    emit({"k": "start", "hook": False})
    return send


def _run(runner, args, send):
    """Run the runner with the seal's reporting; the runner's exit code. Everything the hook needs to
    know of the runner goes to it once, here (`allow`), before any code of the repository runs."""
    case = _guard_should_stop()
    if runner == "pytest":
        import _pytest.reports
        import _pytest.runner
        import pytest

        plugin = _pytest_plugin(pytest, send)
        _allow(send, _codes(type(plugin)), case, {"call_and_report": _pytest.runner.call_and_report.__code__,
                                                  "TestReport": _pytest.reports.TestReport, "seal_at": "conftests"})
        send("start", None)
        code = int(pytest.main(args, plugins=[plugin]))
    else:
        import unittest

        runner_cls = _unittest_runner(unittest, send)
        _allow(send, _codes(runner_cls.resultclass) | _codes(runner_cls), case, {"seal_at": "start"})
        send("start", None)
        program = unittest.main(module=None, argv=["python -m unittest"] + args, exit=False, testRunner=runner_cls)
        code = 0 if program.result.wasSuccessful() else 1
    send("end", code)
    return code


def _allow(send, senders, case, runner):
    """Tell the hook who may report (the reporting methods' code) and the runner's own pieces."""
    if case is not None:
        runner.update({"TestCase": case.TestCase, "TestCase.run": case.TestCase.run.__code__,
                       "TestCase names": frozenset(n for n in dir(case.TestCase) if callable(getattr(case.TestCase, n))),
                       "_ErrorHolder": getattr(sys.modules.get("unittest.suite"), "_ErrorHolder", None)})
    if hasattr(sys, "addaudithook"):
        send("allow", (frozenset(senders) | {_run.__code__}, runner))


def _guard_should_stop():
    """unittest counts a test passed when its part raises `_ShouldStop` (it raises that itself only
    after a failure under failfast, or for an expected failure). Any other `_ShouldStop` (the patch's)
    becomes an error of that test part. Returns `unittest.case`, or None where there is no unittest."""
    try:
        import contextlib
        import unittest.case as case
    except ImportError:
        return None
    outcome, stop = getattr(case, "_Outcome", None), getattr(case, "_ShouldStop", None)
    original = getattr(outcome, "testPartExecutor", None)
    if original is None or stop is None:
        return case

    @contextlib.contextmanager
    def testPartExecutor(self, test_case, subTest=False):
        with original(self, test_case, subTest):
            try:
                yield
            except stop:
                if self.success and not getattr(self, "expectedFailure", None):
                    raise RuntimeError("unittest's _ShouldStop raised by the code under test") from None
                raise

    outcome.testPartExecutor = testPartExecutor
    return case


def _codes(cls):
    """The code objects of a class's own methods (hookwrappers are generator functions: same)."""
    return {v.__code__ for v in vars(cls).values() if hasattr(v, "__code__")}


def _pytest_plugin(pytest, send):
    class SealPlugin:
        def pytest_runtest_logreport(self, report):
            send("report", report)

        def pytest_load_initial_conftests(self):
            send("conftests", None)  # after pytest's own tryfirst patches, before the repository's conftests

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtestloop(self, session):
            send("freeze", session.config.pluginmanager)  # collected, before the first test
            yield

    return SealPlugin()


def _unittest_runner(unittest, send):
    class SealResult(unittest.TextTestResult):
        def _seal(self, test, status):
            send("report", (test, status))

        def addSuccess(self, test):
            self._seal(test, "passed")
            super().addSuccess(test)

        def addFailure(self, test, err):
            self._seal(test, "failed")
            super().addFailure(test, err)

        def addError(self, test, err):
            self._seal(test, "error")
            super().addError(test, err)

        def addSkip(self, test, reason):
            self._seal(test, "skipped")
            super().addSkip(test, reason)

        def addExpectedFailure(self, test, err):
            self._seal(test, "xfailed")
            super().addExpectedFailure(test, err)

        def addUnexpectedSuccess(self, test):
            self._seal(test, "failed")
            super().addUnexpectedSuccess(test)

        def addSubTest(self, test, subtest, err):
            if err is not None:
                self._seal(test, "failed" if issubclass(err[0], test.failureException) else "error")
            super().addSubTest(test, subtest, err)

    class SealRunner(unittest.TextTestRunner):
        resultclass = SealResult

        def run(self, test):
            send("freeze", None)  # loaded, before the first test
            return super().run(test)

    return SealRunner


if __name__ == "__main__":
    sys.exit(main())
