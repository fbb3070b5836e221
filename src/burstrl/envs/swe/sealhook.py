"""The sealed run's audit hook: the only holder of the key and the results pipe (`sealboot.py` explains
the whole seal; `sealtrust.py` says which code is trusted). Standalone, standard library only.

Nothing a walk of Python objects can reach leads to the key: it lives in the closure of the hook and
its helpers, and the interpreter alone holds the hook (no Python API lists audit hooks). Reporting
code sends a result by raising the audit event `burstrl.seal` through `send`, a module-level
function that holds nothing; the hook then checks who sent it (a reporting method of the seal's
own, nothing untrusted on the stack) and that the result is one the runner really made: a pytest
report must be the `report` of a live frame of the runner's own `call_and_report` for that item, a
unittest outcome must come from a live frame of `TestCase.run` for that very test. A passing result
also needs the test's own code trusted (its function, and in unittest every override of the
runner's methods in its class and on the instance) and the runner unchanged since the freeze. Only
then is the result signed and written.
"""

import functools
import hashlib
import hmac
import json
import os
import struct
import sys
from types import FunctionType

from sealtrust import (
    Snapshot,
    class_dict,
    class_mro,
    class_name,
    code_of,
    library_prefixes,
    make_trusted,
    test_modules,
    trusted_roots,
)

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
# stdlib modules whose every function that takes the caller's frame hands it (or its lines) on
FRAME_MODULES = ("inspect.py", "traceback.py")
PROC_ENTRIES = frozenset({"cmdline", "environ", "mem", "fd", "fdinfo", "maps", "smaps", "auxv", "task", "pagemap"})
CREDITED = frozenset({"passed", "xfailed", "xpassed"})
GETSET = type(type.__dict__["__dict__"])
REPORT_FIELDS = ("nodeid", "when", "outcome", "wasxfail", "__getattribute__", "__getattr__", "__dict__")


def send(kind, obj):
    """How reporting code hands the hook a result: an audit event (holds nothing a walk could use)."""
    sys.audit("burstrl.seal", kind, obj)


def install(key, wfd, run, senders_from):
    """Install the hook (holding the key and the pipe in its closure). `run`: (the patch's paths, the
    seal's directory, the log, the start marker's ctime, the graded tests' files, the graded tests'
    names: empty = every `test*`). `senders_from`: the code of the one function that may name the
    reporting methods (`allow`), once, before the runner starts."""
    import _thread

    changed, rdir, log, t0, tests, graded_names = run
    lock, busy = _thread.allocate_lock(), set()
    state = {"n": 0, "senders": None, "runner": {}, "frozen": False, "snap": Snapshot()}
    repo = os.getcwd()
    lib = library_prefixes()
    rdir = os.path.abspath(rdir) + os.sep
    scratch = os.path.dirname(os.path.abspath(log)) + os.sep
    boot = frozenset(os.path.join(rdir, name) for name in ("seal.py", "sealhook.py", "sealtrust.py"))
    trusted = make_trusted(repo, changed, t0, boot, (rdir, scratch), trusted_roots(repo, sys.path))
    tests = frozenset(os.path.join(repo, p) for p in tests)
    frame_files = tuple(os.path.join(p, m) for p in lib for m in FRAME_MODULES)
    getframe, get_ident, write, getpid, exit_now = sys._getframe, _thread.get_ident, os.write, os.getpid, os._exit
    send_code = send.__code__

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

    def through_helpers(f, whole_modules):
        """Past the stdlib helpers that hand frames on (`whole_modules`: every function of inspect
        and traceback, for a frame taken from the stack: extract_stack, format_stack, stack...)."""
        while f is not None and f.f_code.co_filename.startswith(lib) and (
                f.f_code.co_name in PASS_THROUGH or (whole_modules and f.f_code.co_filename in frame_files)):
            f = f.f_back
        return f

    verified, verified_ids = [], set()  # pytest hook implementations already checked (kept alive: no id reuse)

    def live_frame(f, code, name, obj):
        """The nearest frame above `f` running `code` whose local `name` is `obj`, None if none."""
        while f is not None:
            if f.f_code is code and f.f_locals.get(name) is obj:
                return f
            f = f.f_back
        return None

    def check_runner(rule):
        bad = state["snap"].changed(trusted)
        if bad is not None:
            refuse(rule, "the runner's %s is not the one it started with" % bad, None)

    def on_seal(kind, obj, f):
        sender = f.f_back if f is not None and f.f_code is send_code else None
        if kind == "allow":
            if sender is None or sender.f_code is not senders_from or state["senders"] is not None:
                refuse("forged_message", "a second or foreign allow", untrusted_on_stack(f) or sender or f)
            state["senders"], state["runner"] = frozenset(obj[0]), dict(obj[1])
            return
        if sender is None or (sender.f_code not in (state["senders"] or ()) and sender.f_code not in GUARD_CODES):
            refuse("forged_message", "a seal message not sent by the seal's own reporting",
                   untrusted_on_stack(f) or sender or f)
        if kind == "test_call":
            test_called(obj, sender)
            return
        if untrusted_on_stack(f):
            refuse("forged_message", "a seal message sent with the patch's code on the stack", untrusted_on_stack(f))
        if kind in ("start", "conftests", "freeze"):
            snapshot(kind, obj)
        elif kind == "report":
            report(obj, sender)
        elif kind == "end":  # the runner has returned (pytest has undone its own patches): nothing to check
            emit({"k": "end", "exit": obj})

    def snapshot(kind, plugins):
        """start (the runner imported), conftests (pytest, before the repository's conftests), freeze
        (before the first test): see `sealtrust.Snapshot`."""
        snap, runner = state["snap"], state["runner"]
        if not state["frozen"]:
            check_runner("runner_patched")
        sealing = kind == "freeze" or kind == runner.get("seal_at")
        if kind == "freeze":
            guard_tests()
        snap.add_runner(sys.modules, sealed=sealing)
        if kind == "freeze":
            snap.add_tests(sys.modules, tests)
            state["frozen"], state["plugins"] = True, plugins
            check_plugins()
        if sealing:
            snap.seal()

    def guard_tests():
        """The graded tests' functions and methods in their modules, wrapped so that a call of one tells
        the hook (`test_called`); the runner's collected items already hold the originals."""
        def graded(key, value):
            return type(value) is FunctionType and plain_function(value) and (
                key in graded_names if graded_names else key.startswith("test"))

        for name, module in test_modules(sys.modules, tests):
            d = module.__dict__
            for key, obj in list(d.items()):
                if graded(key, obj):
                    d[key] = guarded(obj, False)
                elif issubclass(type(obj), type) and class_dict(obj).get("__module__") == name:
                    for attr, value in list(class_dict(obj).items()):
                        if graded(attr, value):
                            type.__setattr__(obj, attr, guarded(value, True))

    def test_called(obj, sender):
        """A test of the repository runs only inside the runner's protocol, with nothing of the patch's
        on the stack, and (a method) on an instance whose class is the repository's: a patch that
        calls the tests to learn what they expect (a fake `self` that records them) is tamper."""
        bad = untrusted_on_stack(sender)
        if bad is not None:
            refuse("test_called", "a test of the repository called by the patch's code", bad)
        runner = state["runner"]
        protocol = runner.get("call_and_report") or runner.get("TestCase.run")
        f = sender
        while f is not None and f.f_code is not protocol:
            f = f.f_back
        if f is None or (protocol is runner.get("TestCase.run") and obj is not None
                         and f.f_locals.get("self") is not obj):
            refuse("test_called", "a test of the repository called outside the runner's run of it", None)
        if obj is not None:
            test_code_trusted(type(obj), obj, "")

    def check_plugins():
        """Every hook implementation registered with pytest is trusted code (a plugin of the patch's,
        registered through an object it found, could rewrite reports as they are made)."""
        pm = state.get("plugins")
        relay = getattr(pm, "hook", None)
        for caller in list(getattr(relay, "__dict__", {}).values()):
            for impl in list(getattr(caller, "_hookimpls", None) or ()):
                if id(impl) in verified_ids:
                    continue
                code = code_of(getattr(impl, "function", None))
                if code is None or not trusted(code.co_filename):
                    refuse("runner_patched", "a pytest plugin of the patch's (%s)" % getattr(impl, "plugin_name", "?"),
                           None)
                verified.append(impl)
                verified_ids.add(id(impl))

    def report(obj, sender):
        if type(obj) is tuple:  # unittest: (test, status); bound to its run before anything of it is asked
            test, status = obj
            known = type(status) is str and status in ("passed", "failed", "error", "skipped", "xfailed")
            status = status if known else "error"
            if live_frame(sender, runner_code("TestCase.run"), "self", test) is not None:
                test_code_trusted(type(test), test, "")
            elif status in CREDITED:
                refuse("forged_message", "a unittest pass that no running TestCase.run made", None)
            elif type(test) is not state["runner"].get("_ErrorHolder"):
                return  # not a pass and not the runner's: nothing it could claim
            msg = {"id": str(test.id()), "status": status}
            if status in CREDITED:
                check_runner("runner_patched")
        else:  # pytest: the report object
            msg = report_fields(obj)
            if (msg["when"] == "call" and msg["outcome"] == "passed") or msg["xfail"]:  # what can be credited
                check_plugins()
            bound = live_frame(sender, runner_code("call_and_report"), "report", obj)
            if bound is None:  # made during a test's call (pytest's subtests): for the item running now
                item, call = running_item(msg["id"], sender), None
            else:
                item, call = bound.f_locals.get("item"), bound.f_locals.get("call")
            if str(getattr(item, "nodeid", "")) != msg["id"]:
                refuse("forged_message", "a report for %s made for another item" % msg["id"], None)
            if msg["when"] == "call" and bound is not None:
                msg["raised"] = getattr(call, "excinfo", None) is not None
                pytest_item_trusted(item, msg["id"])
                check_runner("runner_patched")
        msg["k"] = "report"
        emit(msg)

    def report_fields(obj):
        """A pytest report's fields, read only once nothing but the runner's code answers for them:
        its class is the runner's TestReport or a subclass that overrides none of them untrusted."""
        mro, case = class_mro(type(obj)), state["runner"].get("TestReport")
        if case not in mro:
            refuse("forged_message", "a pytest report that is not one of the runner's", None)
        for klass in mro[:mro.index(case)]:
            for name in REPORT_FIELDS:
                value = class_dict(klass).get(name)
                if value is not None:
                    overrides(klass, name, value, False)
        msg = {"id": obj.nodeid, "when": obj.when, "outcome": obj.outcome, "xfail": hasattr(obj, "wasxfail"),
               "raised": None}
        if not all(type(msg[k]) is str for k in ("id", "when", "outcome")):
            refuse("forged_message", "a pytest report whose fields are not plain strings", None)
        return msg

    def running_item(nodeid, sender):
        """The item whose call is running in this thread, for a report made inside it (a subtest's)."""
        code, f = runner_code("call_and_report"), sender
        while f is not None:
            if f.f_code is code and str(getattr(f.f_locals.get("item"), "nodeid", "")) == nodeid:
                return f.f_locals.get("item")
            f = f.f_back
        refuse("forged_message", "a pytest report that no running call of its test made", None)

    def runner_code(name):
        code = state["runner"].get(name)
        if code is None:
            refuse("seal_error", "the runner's %s is unknown to the seal" % name, None)
        return code

    def pytest_item_trusted(item, tid):
        code = code_of(getattr(item, "function", None))
        if code is not None and not trusted(code.co_filename):
            refuse("test_replaced", "%s runs %s, not the repository's test" % (tid, code.co_filename), None)
        cls = getattr(item, "cls", None)
        case = state["runner"].get("TestCase")
        if type(cls) is not type or case is None or case not in class_mro(cls):
            return
        instance = getattr(item, "_testcase", None) or getattr(item, "instance", None)
        test_code_trusted(cls, instance if type(instance) is cls else None, getattr(item, "name", "").split("[", 1)[0])

    def test_code_trusted(cls, instance, method):
        """The test's method and every override of the runner's TestCase attributes in its classes (and
        on the instance) are trusted code: a class swapped in, or an assertion replaced, is tamper."""
        runner = state["runner"]
        names, case = runner.get("TestCase names", frozenset()), runner.get("TestCase")
        classes = []
        for klass in class_mro(cls):
            if klass is case:
                break
            classes.append(klass)
        for klass in classes:  # the overrides first: after them, reading the instance runs trusted code
            for name, value in list(class_dict(klass).items()):
                if name in names or name == "__dict__":
                    overrides(klass, name, value, False)
        own = _instance_dict(instance)
        for name in list(own):
            if name in names:
                refuse("test_replaced", "the test instance's own %s" % name, None)
        method = method or own.get("_testMethodName")
        for klass in classes:
            value = class_dict(klass).get(method) if type(method) is str else None
            if value is not None:
                overrides(klass, method, value, True)
                break

    def overrides(klass, name, value, must_be_code):
        if name == "__dict__" and type(value) is GETSET:
            return
        code = code_of(value)
        if (code is None and must_be_code) or (code is not None and not trusted(code.co_filename)) \
                or (name == "__dict__"):
            where = code.co_filename if code is not None else type(value).__name__
            refuse("test_replaced", "%s.%s is %s" % (class_name(klass), name, where), None)

    def relevant(event, args):
        """Cheap filters first: most watched events (every `__code__` read, open, import) are not."""
        if event == "object.__getattr__":
            return args[1] in FRAME_ATTRS
        if event == "object.__setattr__":
            return args[1] == "__code__"
        if event == "import":
            return args[0] in ("ctypes", "_ctypes")
        if event in ("open", "os.listdir", "os.scandir"):
            return bool(sealed_path(args[0] if args else None))
        return True

    def sealed_path(path):
        """"proc", "seal", "test" (a graded test's source), "pyc" (bytecode written at run time), ""."""
        if isinstance(path, int) or path is None:
            return ""
        p = os.path.abspath(os.fsdecode(path))
        if p.startswith(rdir) or p + os.sep == rdir:
            return "seal"
        if p in tests:
            return "test"
        if p.endswith(".pyc"):
            st = _stat(p)
            return "pyc" if st is not None and st.st_ctime_ns >= t0 else ""
        parts = p.split(os.sep)
        if len(parts) >= 4 and parts[1] == "proc" and (parts[2] in ("self", "thread-self") or parts[2].isdigit()):
            return "proc" if parts[3] in PROC_ENTRIES else ""
        return ""

    def check(event, args):
        f = caller()
        if event == "burstrl.seal":
            on_seal(args[0], args[1], f)
        elif event == "object.__getattr__":
            g = through_helpers(f, False)
            if g is not None and not trusted(g.f_code.co_filename):
                refuse("frame", "%s of a %s" % (args[1], type(args[0]).__name__), g)
        elif event in ("sys._getframe", "sys._current_frames"):
            g = through_helpers(f, True)
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
            g = f  # imported by the patch's own code, not by a library
            while g is not None and g.f_code.co_filename.startswith("<frozen "):
                g = g.f_back
            if g is not None and not trusted(g.f_code.co_filename):
                refuse("ctypes", "import " + args[0], g)
        elif event in ("open", "os.listdir", "os.scandir"):
            why = sealed_path(args[0] if args else None)
            if why == "pyc":  # nothing honest loads bytecode written during its own run (no bytecode is written)
                refuse("forged_code", "bytecode written during the run: %s" % os.fsdecode(args[0]), untrusted_on_stack(f))
            g = initiator(f)
            if g is not None and not trusted(g.f_code.co_filename):
                rule = {"proc": "proc_self", "test": "test_source"}.get(why, "report_path")
                refuse(rule, "%s %s" % (event, os.fsdecode(args[0])), g)
        elif event == "object.__setattr__":
            if f is not None and not trusted(f.f_code.co_filename):
                refuse("code_swap", "__code__ of %r replaced" % (getattr(args[0], "__qualname__", "?"),), f)
        elif event in ("compile", "code.__new__"):
            name = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            if name and trusted(name) and f is not None and not trusted(f.f_code.co_filename):
                refuse("forged_code", "%s of code claiming to be %s" % (event, name), f)
        elif event == "marshal.loads":
            if f is not None and not trusted(f.f_code.co_filename):
                refuse("forged_code", "marshal.loads", f)
        else:
            tracing(event, f)

    def tracing(event, f):
        """sys.settrace / setprofile / addaudithook: refused from untrusted code (also through threading)."""
        if f is not None and os.path.basename(f.f_code.co_filename) == "threading.py" and "threading" in sys.modules:
            hook_fn = getattr(sys.modules["threading"], "_trace_hook" if event == "sys.settrace" else "_profile_hook",
                              None)
            code = getattr(hook_fn, "__code__", None)
            if code is not None and not trusted(code.co_filename):
                refuse("tracing", "%s of %s through threading" % (event, code.co_filename), f)
            return
        if f is not None and not trusted(f.f_code.co_filename):
            refuse("tracing" if event != "sys.addaudithook" else "audit_hook", event, f)

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

    own = frozenset(fn.__code__ for fn in (hook, check, caller, on_seal, refuse, report, snapshot, tracing,
                                           pytest_item_trusted, test_code_trusted, check_runner, check_plugins,
                                           runner_code, overrides, guard_tests, test_called,
                                           running_item, report_fields))
    sys.addaudithook(hook)
    emit({"k": "start", "hook": True})


def guarded(fn, method):
    """`fn` (a test of the repository) behind a guard that reports each call to the hook first."""
    if method:
        def test_guard(self, *args, **kwargs):
            send("test_call", self)
            return fn(self, *args, **kwargs)
    else:
        def test_guard(*args, **kwargs):
            send("test_call", None)
            return fn(*args, **kwargs)
    return functools.wraps(fn)(test_guard)


GUARD_CODES = frozenset(c for c in guarded.__code__.co_consts if type(c) is type(guarded.__code__))


def plain_function(fn):
    """Not a coroutine, generator or async generator function (a guard would hide what it is)."""
    return not fn.__code__.co_flags & (0x20 | 0x80 | 0x200)


def _instance_dict(obj):
    """An object's own attributes, read through the `__dict__` slot its class really has (never a
    descriptor or `__getattribute__` of the object's own code); {} when there is none."""
    if obj is None:
        return {}
    for klass in class_mro(type(obj)):
        slot = class_dict(klass).get("__dict__")
        if slot is not None:
            d = slot.__get__(obj) if type(slot) is GETSET else None
            return d if type(d) is dict else {}
    return {}


def _stat(path):
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None
