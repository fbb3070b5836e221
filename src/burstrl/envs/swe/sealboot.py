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
- the test process installs a CPython audit hook (PEP 578: it cannot be removed) before it imports
  the runner, then runs the runner with a reporting plugin (pytest) or result class (unittest). The
  key and the pipe live only in the hook's closure: the plugin hands each result to the hook with
  `sys.audit`, the hook checks who sent it (no frame of untrusted code on the stack) and that the
  runner's functions and classes are still the ones it started with, signs it and writes it. The
  hook also watches the primitives a forgery needs (frames, heap walks, ctypes memory access, the
  seal's files, the process's /proc entries, code swaps, code claiming a trusted file, trace hooks,
  more audit hooks); when code the patch brought uses one, the hook sends a signed `tamper` message
  and ends the process at once (the primitive never returns). After the runner returns the end
  message goes out and the process `os._exit`s: exit handlers never run after the results are in.

Trusted code: the Python installation (stdlib, site-packages), frozen modules, this file, and the
repository's files that the patch did not change, unchanged on disk since the start (by stat).
Everything else is the patch's: its files, files written at run time, code compiled from strings.
"""

import hashlib
import hmac
import json
import os
import select
import site
import struct
import sys
import sysconfig
from types import FunctionType

TAG = "burstrl-seal "  # prefix of the verdict line on the collector's stdout
MAX_MESSAGE = 1 << 20
SEVERITY = {"error": 4, "failed": 3, "skipped": 2, "xfailed": 2, "xpassed": 1, "passed": 0}
RUNNER_PREFIXES = ("pytest", "_pytest", "pluggy", "unittest", "__main__")
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
GC_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
# ctypes reading or writing memory: called directly (from_address, foreign functions; multiprocessing
# uses from_address itself) or through ctypes' own Python helpers (string_at, wstring_at, PyObj_FromPtr)
CTYPES_DIRECT = frozenset({"ctypes.cdata", "ctypes.call_function"})
CTYPES_EVENTS = frozenset({"ctypes.string_at", "ctypes.wstring_at", "ctypes.PyObj_FromPtr"}) | CTYPES_DIRECT
WATCHED = frozenset({"burstrl.seal", "sys._getframe", "sys._current_frames", "object.__getattr__",
                     "object.__setattr__", "open", "os.listdir", "os.scandir", "compile", "code.__new__",
                     "marshal.loads", "sys.settrace", "sys.setprofile", "sys.addaudithook", "import"}) | GC_EVENTS | CTYPES_EVENTS
# stdlib helpers that hand their caller a frame: the frame check looks through them to who called
PASS_THROUGH = frozenset({"currentframe", "stack", "trace", "getouterframes", "getinnerframes", "walk_stack",
                          "walk_tb", "<lambda>"})
PROC_ENTRIES = frozenset({"cmdline", "environ", "mem", "fd", "fdinfo", "maps", "smaps", "auxv", "task", "pagemap"})


# ---- the collector ----

def main():
    rdir, log, runner, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    changed, graded = _take_list(rdir, "changed"), _take_list(rdir, "graded")
    _nondumpable()  # before the fork: the test process inherits it
    pid, r, key = _start(log, runner, args, changed, rdir)
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


def _start(log, runner, args, changed, rdir):
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
        _test_process(box, w, log, runner, args, changed, rdir)  # never returns
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

def _test_process(box, w, log, runner, args, changed, rdir):
    code = 70
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for name in [m for m in sys.modules if m.split(".", 1)[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]  # the patch's own `import ctypes` must reach the hook
        sys.argv = ["python -m " + runner] + list(args)
        sys.path[0] = os.getcwd()  # as `python -m` has it: the working directory first
        send, allow = _install(box.pop(), w, changed, rdir)
        code = _run(runner, list(args), send, allow)
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


def _install(key, wfd, changed, rdir):
    """The audit hook (holding the key and the pipe in its closure) and the sender the plugin calls."""
    import _thread

    lock, busy = _thread.allocate_lock(), set()
    state = {"n": 0, "pid": os.getpid(), "snap": [], "senders": frozenset()}
    lib = _library_prefixes()
    base = _repo_files(os.getcwd())
    changed = frozenset(os.path.join(os.getcwd(), p) for p in changed)
    boot = os.path.abspath(__file__)
    rdir = os.path.abspath(rdir) + os.sep
    getframe, get_ident, write, getpid, exit_now = sys._getframe, _thread.get_ident, os.write, os.getpid, os._exit

    fixed = {}  # filename -> trust, for every file that is not the repository's (those are stat'ed each time)

    def trusted(filename):
        known = fixed.get(filename)
        if known is not None:
            return known
        st = base.get(filename)
        if st is None or filename in changed:
            known = filename == boot or filename.startswith("<frozen ") or filename.startswith(lib)
            if st is None and len(fixed) < 100000:
                fixed[filename] = known
            return known
        try:
            now = os.stat(filename)
        except OSError:
            return False
        return (now.st_mtime_ns, now.st_size, now.st_ino) == st

    def emit(msg):
        with lock:
            msg["n"], msg["pid"] = state["n"], getpid()
            body = json.dumps(msg, sort_keys=True).encode()
            frame = struct.pack(">I", len(body)) + hmac.new(key, body, hashlib.sha256).digest() + body
            while frame:
                frame = frame[write(wfd, frame):]
            state["n"] += 1

    def refuse(rule, detail, frame):
        where = "%s:%d" % (frame.f_code.co_filename, frame.f_lineno) if frame is not None else "?"
        emit({"k": "tamper", "why": "%s: %s (from %s)" % (rule, detail, where)})
        exit_now(86)

    def caller():
        f = getframe(1)
        while f is not None and f.f_code in own:
            f = f.f_back
        return f

    def initiator(f):
        """The nearest frame above `f` (included) that is not the Python installation's."""
        while f is not None and (f.f_code.co_filename.startswith(lib) or f.f_code.co_filename.startswith("<frozen ")):
            f = f.f_back
        return f

    def untrusted_on_stack(f):
        while f is not None:
            if not trusted(f.f_code.co_filename):
                return f
            f = f.f_back
        return None

    def through_helpers(f):
        while f is not None and f.f_code.co_name in PASS_THROUGH and f.f_code.co_filename.startswith(lib):
            f = f.f_back
        return f

    def runner_changed():
        """The first of the runner's functions and classes replaced by something that is not a
        function of trusted code (pytest patches itself: legacypath replaces a Config method)."""
        snap = state["snap"]
        for i in range(1, len(snap)):
            d, k, obj, label = snap[i]
            new = d.get(k)
            if new is obj:
                continue
            fn = getattr(new, "__func__", None) or getattr(new, "fget", None) or new
            if isinstance(fn, FunctionType) and trusted(fn.__code__.co_filename):
                snap[i] = (d, k, new, label)
                continue
            return "%s.%s" % (label, k)
        return None

    def on_seal(args, f):
        kind, payload = args[0], args[1]
        sender = f.f_back if f is not None and f.f_code in state["send"] else None
        if sender is None or sender.f_code not in state["senders"] or untrusted_on_stack(f):
            refuse("forged_message", "a seal message not sent by the seal's own reporting",
                   untrusted_on_stack(f) or sender or f)
        if kind == "snapshot":
            _snapshot(state["snap"])
            return
        # the runner's identity at every result that can pass (a call, a unittest outcome) and at the end
        bad = runner_changed() if payload.get("when") in (None, "call") else None
        if bad is not None:
            refuse("runner_patched", "the runner's %s is not the one it started with" % bad, None)
        msg = dict(payload)
        msg["k"] = kind
        emit(msg)

    def relevant(event, args):
        """Cheap filters first: most watched events (every `__code__` read, open, import) are not."""
        if event == "object.__getattr__":
            return args[1] in FRAME_ATTRS
        if event == "object.__setattr__":
            return args[1] == "__code__"
        if event == "import":
            return args[0] in ("ctypes", "_ctypes")
        if event in ("open", "os.listdir", "os.scandir"):
            return bool(_sealed_path(args[0] if args else None, rdir))
        return True

    def check(event, args):
        f = caller()
        if event == "burstrl.seal":
            on_seal(args, f)
        elif event == "object.__getattr__":
            if args[1] in FRAME_ATTRS:
                g = through_helpers(f)
                if g is not None and not trusted(g.f_code.co_filename):
                    refuse("frame", "%s of a %s" % (args[1], type(args[0]).__name__), g)
        elif event in ("sys._getframe", "sys._current_frames"):
            g = through_helpers(f)
            if g is not None and not trusted(g.f_code.co_filename):
                refuse("frame", event, g)
        elif event in GC_EVENTS:
            g = initiator(f)
            if g is not None and not trusted(g.f_code.co_filename):
                refuse("gc", event, g)
        elif event in CTYPES_EVENTS:
            g = f if event in CTYPES_DIRECT else initiator(f)
            if g is not None and not trusted(g.f_code.co_filename):
                refuse("ctypes", event, g)
        elif event == "import":
            if args[0] in ("ctypes", "_ctypes"):  # imported by the patch's own code, not by a library
                g = f
                while g is not None and g.f_code.co_filename.startswith("<frozen "):
                    g = g.f_back
                if g is not None and not trusted(g.f_code.co_filename):
                    refuse("ctypes", "import " + args[0], g)
        elif event in ("open", "os.listdir", "os.scandir"):
            path = args[0] if args else None
            why = _sealed_path(path, rdir)
            if why:
                g = initiator(f)
                if g is not None and not trusted(g.f_code.co_filename):
                    refuse("proc_self" if why == "proc" else "report_path", "%s %s" % (event, os.fsdecode(path)), g)
        elif event == "object.__setattr__":
            if args[1] == "__code__" and f is not None and not trusted(f.f_code.co_filename):
                refuse("code_swap", "__code__ of %r replaced" % (getattr(args[0], "__qualname__", "?"),), f)
        elif event in ("compile", "code.__new__"):
            name = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            if name and trusted(name) and f is not None and not trusted(f.f_code.co_filename):
                refuse("forged_code", "%s of code claiming to be %s" % (event, name), f)
        elif event == "marshal.loads":
            if f is not None and not trusted(f.f_code.co_filename):
                refuse("forged_code", "marshal.loads", f)
        elif event in ("sys.settrace", "sys.setprofile", "sys.addaudithook"):
            g = f
            if f is not None and os.path.basename(f.f_code.co_filename) == "threading.py" and "threading" in sys.modules:
                hook_fn = getattr(sys.modules["threading"], "_trace_hook" if event == "sys.settrace" else "_profile_hook",
                                  None)
                code = getattr(hook_fn, "__code__", None)
                g = None if code is None or trusted(code.co_filename) else f
                if g is not None:
                    refuse("tracing", "%s of %s through threading" % (event, code.co_filename), g)
                return
            if g is not None and not trusted(g.f_code.co_filename):
                refuse("tracing" if event != "sys.addaudithook" else "audit_hook", event, g)

    def hook(event, args):
        if event not in WATCHED:
            return
        ident = get_ident()
        if ident in busy:
            return
        busy.add(ident)
        try:
            if relevant(event, args):
                check(event, args)
        except BaseException as exc:  # an input the hook did not expect: never let it skip a check
            emit({"k": "tamper", "why": "seal_error: %s on %s: %r" % (type(exc).__name__, event, exc)})
            exit_now(86)
        finally:
            busy.discard(ident)

    own = frozenset(fn.__code__ for fn in (hook, check, caller, on_seal, refuse))
    has_hook = hasattr(sys, "addaudithook")

    def send(kind, payload):
        if has_hook:
            sys.audit("burstrl.seal", kind, payload)
        else:  # Python < 3.8: the signed channel without the hook (the verdict says "hook": false)
            emit(dict(payload, k=kind))

    def allow(codes):
        """Once, before the runner is imported: the code objects that may call `send`."""
        if not state["senders"]:
            state["senders"] = frozenset(codes)

    state["send"] = frozenset({send.__code__})
    if has_hook:
        sys.addaudithook(hook)
    emit({"k": "start", "hook": has_hook})
    return send, allow


def _run(runner, args, send, allow):
    """Run the runner with the seal's reporting; the runner's exit code."""
    if runner == "pytest":
        import pytest
        plugin = _pytest_plugin(pytest, send)
        allow(_codes(type(plugin)) | {_run.__code__})
        send("snapshot", {})
        code = int(pytest.main(args, plugins=[plugin]))
    else:
        import unittest
        runner_cls = _unittest_runner(unittest, send)
        allow(_codes(runner_cls.resultclass) | {_run.__code__})
        send("snapshot", {})
        program = unittest.main(module=None, argv=["python -m unittest"] + args, exit=False, testRunner=runner_cls)
        code = 0 if program.result.wasSuccessful() else 1
    send("end", {"exit": code})
    return code


def _codes(cls):
    """The code objects of a class's own methods (hookwrappers are generator functions: same)."""
    return {v.__code__ for v in vars(cls).values() if hasattr(v, "__code__")}


def _pytest_plugin(pytest, send):
    class SealPlugin:
        def __init__(self):
            self.raised = {}

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            outcome = yield
            self.raised[item.nodeid] = outcome.excinfo is not None

        def pytest_runtest_logreport(self, report):
            raised = self.raised.pop(report.nodeid, None) if report.when == "call" else None
            send("report", {"id": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "xfail": hasattr(report, "wasxfail"), "raised": raised})

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_load_initial_conftests(self):
            send("snapshot", {})  # the plugins pytest loaded before the repository's conftests
            yield

    return SealPlugin()


def _unittest_runner(unittest, send):
    class SealResult(unittest.TextTestResult):
        def _seal(self, test, status):
            send("report", {"id": test.id(), "status": status})

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

    return SealRunner


def _snapshot(snap):
    """(namespace, name, object, label) of every function and class of the runner's modules and their
    classes, added for modules not seen yet; the hook compares them at every message."""
    seen = snap[0] if snap else set()  # ids of the modules and classes already in
    if not snap:
        snap.append(seen)
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".", 1)[0] not in RUNNER_PREFIXES or id(module) in seen:
            continue
        seen.add(id(module))
        d = module.__dict__
        for key, obj in list(d.items()):
            if callable(obj) and not key.startswith("__"):
                snap.append((d, key, obj, name))
            if isinstance(obj, type) and getattr(obj, "__module__", None) == name and id(obj) not in seen:
                seen.add(id(obj))
                ns = vars(obj)  # a live view of the class's namespace
                for attr, value in list(ns.items()):
                    if callable(value) or isinstance(value, (classmethod, staticmethod, property)):
                        snap.append((ns, attr, value, "%s.%s" % (name, obj.__qualname__)))


def _sealed_path(path, rdir):
    """"proc" for this process's /proc entries a forgery reads, "seal" for the seal's directory, ""."""
    if isinstance(path, int) or path is None:
        return ""
    p = os.path.abspath(os.fsdecode(path))
    if p.startswith(rdir) or p + os.sep == rdir:
        return "seal"
    parts = p.split(os.sep)
    if len(parts) >= 4 and parts[1] == "proc" and (parts[2] in ("self", "thread-self") or parts[2].isdigit()):
        return "proc" if parts[3] in PROC_ENTRIES else ""
    return ""


def _library_prefixes():
    paths = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            paths.add(sysconfig.get_paths()[key])
        except KeyError:
            pass
    try:
        paths.update(site.getsitepackages())
    except AttributeError:
        pass
    paths.add(os.path.dirname(os.__file__))
    out = set()
    for p in paths:
        for q in (p, os.path.realpath(p)):
            if q and q != os.sep and not os.getcwd().startswith(q + os.sep) and os.getcwd() != q:
                out.add(q.rstrip(os.sep) + os.sep)
    return tuple(sorted(out))


def _repo_files(root):
    """Every .py file under the repository (not .git) by absolute path -> (mtime_ns, size, inode)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                out[path] = (st.st_mtime_ns, st.st_size, st.st_ino)
    return out


if __name__ == "__main__":
    sys.exit(main())
