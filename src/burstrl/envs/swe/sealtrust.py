"""The sealed run's trust rule and runner snapshot: which code is the task's, and whether the runner is
still the one it started with. Part of the bootstrap (`sealboot.py` imports it from the seal's own
directory inside the grading sandbox): standard library only, Python 3.8+, nothing of burstrl.

Trusted code is what the task's image provides and the repository's files the patch did not change:
- the interpreter's own install (stdlib, site-packages) and every `sys.path` entry present when the
  seal starts (PYTHONPATH, a virtualenv, `.pth` entries: an image layer with the test runner at
  `/work/.pydeps`, a venv in `/opt`), for files that existed before the run began: a file whose
  ctime is not older than the seal's start marker was written at run time, and a file that is one
  of the patch's (by inode: a link or a moved directory) is the patch's wherever it appears;
- the repository's files the patch did not change, unchanged on disk since the start (by stat);
- frozen modules and the seal's own files.
Everything else is the patch's: its files, anything written at run time, code compiled from strings.
The seal's directory and the grader's scratch directory are never trusted (the grader writes the
patch there). A file on a read-only filesystem keeps its first answer; others are checked each time.

The snapshot: (namespace, name, object, label, sealed) of every function and class of the runner's
modules and every method, descriptor and nested class of their classes (data attributes are the
runner's state: pytest keeps its plugin manager in one), plus, from the freeze before the first test, the
graded test modules' functions and classes. A sealed entry that changes is tamper, whatever
replaced it; an unsealed one (pytest before it loads the repository's conftests, when no code of the
patch has run yet: its legacypath plugin and installed plugins such as hypothesis's patch pytest's
classes) may be replaced by trusted code.
"""

import os
import site
import sysconfig
from types import FunctionType, MethodType, ModuleType

RUNNER_PREFIXES = ("pytest", "_pytest", "pluggy", "unittest", "__main__", "sealtrust")
DESCRIPTORS = (classmethod, staticmethod, property)
DUNDER_KEEP = frozenset({"__init__", "__new__", "__call__", "__eq__", "__ne__", "__getattr__", "__getattribute__",
                         "__setattr__", "__enter__", "__exit__", "__iter__", "__next__", "__bool__", "__len__",
                         "__init_subclass__", "__class_getitem__", "__get__", "__set__", "__hash__"})


def _stat(path):
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def _under(path, prefixes):
    return any(path.startswith(p) for p in prefixes)


def make_trusted(repo, changed, t0, boot_files, private_dirs, roots):
    """`trusted(filename)`: whether code from that file is the task's (see the module docstring).

    `repo`: the repository's absolute path (the run's cwd); `changed`: the patch's paths in it;
    `t0`: the start marker's ctime (ns); `boot_files`: the seal's own files; `private_dirs`: never
    trusted; `roots`: absolute directory prefixes (ending in the separator) whose old files are."""
    base = _repo_files(repo)
    changed = frozenset(os.path.join(repo, p) for p in changed)
    changed_inodes = frozenset((st.st_dev, st.st_ino) for st in map(_stat, changed) if st is not None)
    repo_prefix = repo.rstrip(os.sep) + os.sep
    fixed = {}  # filename -> an answer that cannot change
    real = {}

    def remember(filename, answer):
        if len(fixed) < 100000:
            fixed[filename] = answer
        return answer

    def in_repo(path):
        st = base.get(path)
        if st is None or path in changed:
            return False
        now = _stat(path)
        return now is not None and (now.st_mtime_ns, now.st_size, now.st_ino) == st

    def trusted(filename):
        known = fixed.get(filename)
        if known is not None:
            return known
        if filename.startswith("<frozen ") or os.path.normpath(filename) in boot_files:
            return remember(filename, True)
        if not filename.startswith(os.sep):
            return remember(filename, False)  # "<string>", "<stdin>", a relative name: not a file of the task
        if filename.startswith(repo_prefix):
            return in_repo(filename) if filename in base and filename not in changed else remember(filename, False)
        path = real.get(filename)
        if path is None:
            path = real[filename] = os.path.realpath(filename) if len(real) < 100000 else filename
        if _under(filename, private_dirs) or _under(path, private_dirs):
            return remember(filename, False)
        if path.startswith(repo_prefix):  # a link into the repository: that file's rule
            return in_repo(path)
        if not (_under(filename, roots) or _under(path, roots)):
            return remember(filename, False)
        st = _stat(filename)
        if st is None or st.st_ctime_ns >= t0 or (st.st_dev, st.st_ino) in changed_inodes:
            return False  # written at run time, or the patch's own file seen through a link
        return remember(filename, True) if _read_only(filename) else True

    return trusted


def _read_only(path):
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _install_paths():
    """The interpreter's own install: its stdlib and site-packages directories."""
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
    return paths


def trusted_roots(repo, sys_path):
    """The interpreter's install and the `sys.path` directories at the seal's start, as prefixes."""
    out = set()
    for p in _install_paths() | set(sys_path):
        if not isinstance(p, str) or not os.path.isabs(p) or not os.path.isdir(p):
            continue
        for q in (p, os.path.realpath(p)):
            if q != repo and not q.startswith(repo.rstrip(os.sep) + os.sep):
                out.add(q.rstrip(os.sep) + os.sep)
    return tuple(sorted(out))


def library_prefixes():
    """The interpreter's own install (stdlib and site-packages): where the primitives' helpers live."""
    out = set()
    for p in _install_paths():
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
                st = _stat(path)
                if st is not None:
                    out[path] = (st.st_mtime_ns, st.st_size, st.st_ino)
    return out


# ---- the runner snapshot ----

def code_of(value):
    """The code object behind a function, method, classmethod, staticmethod or property (its getter),
    unwrapped through `__wrapped__`; None for anything else. Type checks only, never `getattr` on
    the object: the hook must not run code of the patch (a `__getattr__`, a `__class__` property)."""
    for _ in range(16):
        kind = type(value)
        if kind is FunctionType:
            wrapped = value.__dict__.get("__wrapped__")
            if wrapped is None:
                return value.__code__
            value = wrapped
        elif issubclass(kind, (staticmethod, classmethod)) or kind is MethodType:
            value = value.__func__
        elif issubclass(kind, property):
            value = value.fget
        else:
            return None
    return None


def class_dict(cls):
    """`vars(cls)` without asking the class (or its metaclass) anything."""
    return _TYPE_DICT.__get__(cls)


def class_mro(cls):
    return _TYPE_MRO.__get__(cls)


def class_name(cls):
    return _TYPE_QUALNAME.__get__(cls)


_TYPE_DICT, _TYPE_MRO, _TYPE_QUALNAME = (type.__dict__[k] for k in ("__dict__", "__mro__", "__qualname__"))


class Snapshot:
    """The runner's (and, after the freeze, the graded test modules') namespaces by identity."""

    def __init__(self):
        self.entries = []  # [namespace, key, object, label, sealed]
        self.classes = []  # [namespace, label, keys when sealed (None until then)]
        self.seen = set()  # ids of the modules and classes already in

    def add_runner(self, modules, sealed):
        for name, module in list(modules.items()):
            if type(module) is not ModuleType or name.split(".", 1)[0] not in RUNNER_PREFIXES or id(module) in self.seen:
                continue
            self.seen.add(id(module))
            d = module.__dict__
            for key, obj in list(d.items()):
                if callable(obj) and not key.startswith("__"):
                    self.entries.append([d, key, obj, name, sealed])
                if issubclass(type(obj), type) and class_dict(obj).get("__module__") == name:
                    self._add_class(obj, name, sealed)

    def add_tests(self, modules, test_files):
        """The graded test modules' functions and classes (and their callables), sealed."""
        for name, module in test_modules(modules, test_files):
            if id(module) in self.seen:
                continue
            self.seen.add(id(module))
            d = module.__dict__
            for key, obj in list(d.items()):
                if type(obj) is FunctionType or issubclass(type(obj), type):
                    self.entries.append([d, key, obj, name, True])
                if issubclass(type(obj), type) and class_dict(obj).get("__module__") == name:
                    self._add_class(obj, name, True)

    def _add_class(self, cls, label, sealed):
        if id(cls) in self.seen:
            return
        self.seen.add(id(cls))
        ns = class_dict(cls)  # a live view of the class's namespace
        where = "%s.%s" % (label, class_name(cls))
        for attr, value in list(ns.items()):
            if attr.startswith("__") and attr not in DUNDER_KEEP:
                continue
            if callable(value) or issubclass(type(value), DESCRIPTORS):
                self.entries.append([ns, attr, value, where, sealed])
        self.classes.append([ns, where, frozenset(ns) if sealed else None])

    def seal(self):
        """From now on every entry is sealed: any change is tamper."""
        for entry in self.entries:
            entry[4] = True
        for cls in self.classes:
            if cls[2] is None:
                cls[2] = frozenset(cls[0])

    def changed(self, trusted):
        """The first entry replaced against the rules ("label.key"), None if none."""
        for entry in self.entries:
            d, key, obj, label, sealed = entry
            new = d.get(key, _MISSING)
            if new is obj:
                continue
            code = code_of(new)
            if not sealed and code is not None and trusted(code.co_filename):
                entry[2] = new  # the runner or its plugins patching it before any repository code ran
                continue
            return "%s.%s (%s, was %s)" % (label, key, _describe(new), _describe(obj))
        for ns, label, keys in self.classes:
            if keys is not None and len(ns) != len(keys):
                added = [k for k, v in list(ns.items()) if k not in keys and (not k.startswith("__") or k in DUNDER_KEEP)
                         and (callable(v) or issubclass(type(v), DESCRIPTORS))]
                if added:
                    return "%s.%s (added)" % (label, added[0])
        return None


_MISSING = object()


def test_modules(modules, test_files):
    """(name, module) of the loaded modules whose file is one of `test_files` (absolute paths)."""
    out = []
    for name, module in list(modules.items()):
        if type(module) is ModuleType:
            path = module.__dict__.get("__file__")
            if type(path) is str and os.path.abspath(path) in test_files:
                out.append((name, module))
    return out


def _describe(value):
    """What replaced an entry, without running any of its code: its type and, for code, its file."""
    if value is _MISSING:
        return "removed"
    code = code_of(value)
    return "%s from %s" % (type(value).__name__, code.co_filename) if code is not None else type(value).__name__
