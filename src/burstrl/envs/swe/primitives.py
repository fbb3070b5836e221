"""The static scan's policy-level rules: what no bug fix adds to a library's code (AST, aliases resolved).

Why refuse these in every mode (training and evaluation, `tampered`, the rule named) instead of
only flagging them: the repository's own tests run in the test runner's process, so code under
test can reach the runner, the tests and the grader's reporting from inside. Every fix-free
hack of issue 48 needs one of a few things that library code has no use for:

- `introspection`: other functions' closure cells (`__closure__`, `cell_contents`,
  `inspect.getclosurevars`), the class graph (`__subclasses__`), writes into a function's
  `__globals__`, writes into `sys.modules` or into modules taken from it, walking `sys.modules`
  (iterating it: a lookup by name is fine), frames (`sys._getframe`, `inspect.currentframe/stack/
  trace`, `f_back`, `f_locals`, `tb_frame`, generator and coroutine frames, `traceback.extract_stack`
  ...), the heap (`gc`) and raw memory (`ctypes`);
- `lying_value`: a class whose `__eq__` is true (or `__ne__` false) whatever it is compared with,
  and the mock library's wildcards (`unittest.mock`, `mock`) outside test files;
- `runner_internals`: unittest's internals (`unittest.case` and the other submodules,
  `_ShouldStop`, `_baseAssertEqual`, ...) and writes to the attributes of the test runners'
  modules and classes (`unittest.TestCase.x = ...`, `setattr(pytest.Function, ...)`);
- `test_access`: non-test code that imports test modules or names the graded test files;
- `unscannable`: a file too deeply nested for the parser (a compiler elsewhere may still run it).

Robust to renaming: `import sys as s`, `from sys import modules as m`, `getattr(x, "__closure__")`,
`vars(sys)["modules"]`, `__import__("gc")`, code in a constant string given to `exec`/`eval`.
What only runs dynamically (names built at run time) is left to the sealed run (`sealboot.py`).
A task set whose real fixes need one of these allows it by name and path glob (`diffpolicy.py`).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from burstrl.envs.swe.lying import EQ_TRUTH, class_lies, module_functions, value_lies

RULE_OF = {  # primitive -> the diff policy's rule
    "closure": "introspection", "subclasses": "introspection", "globals_write": "introspection",
    "sys_modules_write": "introspection", "sys_modules_walk": "introspection", "frame": "introspection",
    "gc": "introspection", "ctypes": "introspection",
    "always_equal": "lying_value", "mock": "lying_value",
    "unittest_internals": "runner_internals", "runner_write": "runner_internals",
    "test_import": "test_access", "test_path": "test_access",
    "too_deep": "unscannable",
}
PRIMITIVES = tuple(RULE_OF)
WHY = {
    "closure": "reads closure cells", "subclasses": "walks the class graph (__subclasses__)",
    "globals_write": "writes into a function's __globals__", "sys_modules_write": "writes into sys.modules or a "
    "module taken from it", "sys_modules_walk": "walks sys.modules", "frame": "reads frames or the call stack",
    "gc": "imports gc (the heap)", "ctypes": "imports ctypes (raw memory)",
    "always_equal": "a value whose __eq__/__ne__ answers the same whatever it is compared with",
    "mock": "the mock library's wildcards outside test files", "unittest_internals": "unittest's internals",
    "runner_write": "writes to a test runner's modules or classes", "test_import": "imports a test module",
    "test_path": "names a graded test file", "too_deep": "nested too deeply to parse",
}
ATTRS = {  # an attribute (or a constant string, as getattr/vars take it) -> primitive, whatever its object
    **dict.fromkeys(("__closure__", "cell_contents", "getclosurevars"), "closure"),
    "__subclasses__": "subclasses",
    **dict.fromkeys(("_getframe", "_getframemodulename", "_current_frames", "currentframe", "getouterframes",
                     "getinnerframes", "extract_stack", "walk_stack", "format_stack", "print_stack", "walk_tb",
                     "f_back", "f_locals", "f_globals", "f_builtins", "tb_frame", "gi_frame", "cr_frame",
                     "ag_frame"), "frame"),
    **dict.fromkeys(("_ShouldStop", "_Outcome", "_baseAssertEqual", "_getAssertEqualityFunc",
                     "_type_equality_funcs", "_callTestMethod", "_feedErrorsToResult"), "unittest_internals"),
}
QUALNAMES = {"inspect.stack": "frame", "inspect.trace": "frame"}
UNITTEST_SUBMODULES = frozenset({"case", "result", "runner", "main", "loader", "suite", "util", "signals",
                                 "async_case", "_log"})
RUNNER_TOPS = frozenset({"unittest", "pytest", "_pytest", "pluggy"})
WRITE_METHODS = frozenset({"update", "setdefault", "__setitem__", "__delitem__", "pop", "popitem", "clear"})
WRITE_FUNCS = frozenset({"setitem", "delitem", "__setitem__", "__delitem__", "update", "setdefault"})
SETATTRS = frozenset({"setattr", "delattr", "__setattr__", "__delattr__"})
MAX_CHAIN = 64  # attribute/getattr links followed when resolving a name
MAX_EXEC_DEPTH = 2  # exec("...") inside exec("...")


TEST_PARTS = frozenset({"tests", "test", "conftest"})  # a test directory, or pytest's conftest


def is_test_path(path: str) -> bool:
    """A file of the tests: under a `tests/` or `test/` directory, or a `conftest.py`. The same
    names make an import a `test_import`, so code exempted here cannot be imported from non-test
    code (a `test_*.py` beside the library's modules is not exempt: library code may import it)."""
    return any(p.removesuffix(".py") in TEST_PARTS for p in path.split("/"))


@dataclass
class _Context:
    """What one file binds: import aliases, names taken from sys.modules or a `__globals__`."""

    test_file: bool
    runner_repo: bool
    graded: tuple[str, ...]  # strings naming the graded test files (paths, dotted modules)
    names: dict[str, str] = field(default_factory=dict)  # local name -> dotted name it is bound to
    parents: dict[int, ast.AST] = field(default_factory=dict)
    from_modules: set[tuple[int, str]] = field(default_factory=set)  # (scope, name) holding a module's part
    from_globals: set[tuple[int, str]] = field(default_factory=set)  # (scope, name) holding a __globals__
    inert: set[int] = field(default_factory=set)  # ids of bare string statements (docstrings)
    defs: dict[str, ast.AST] = field(default_factory=dict)  # the module's top-level functions

    def lies(self, value: ast.AST, name: str) -> bool:
        """`name` (`__eq__`/`__ne__`) set to `value` outside a class body lies (`lying.py`)."""
        return value_lies(value, name, self.defs, lambda node: _qualname(node, self))


def count(tree: ast.AST, *, test_file: bool = False, runner_repo: bool = False, tests: Sequence[str] = (),
          depth: int = 0, walked: tuple[list[ast.AST], dict[int, ast.AST]] | None = None) -> Counter[str]:
    """Primitive -> how many constructs of it the tree holds. `walked`: `walk`'s nodes and parents,
    when the caller has them already (one traversal per file)."""
    ctx = _Context(test_file, runner_repo, _graded_names(tests), defs=module_functions(tree))
    if walked is None:
        nodes = walk(tree, ctx.parents)
    else:
        nodes, ctx.parents = walked
    _bind(nodes, ctx)
    found: Counter[str] = Counter()
    for node in nodes:
        for primitive in _primitives(node, ctx, depth, tests):
            found[primitive] += 1
    if runner_repo:  # the runner's own code: its internals and its use of mock are its business
        for primitive in ("unittest_internals", "runner_write", "mock"):
            found.pop(primitive, None)
    if test_file:  # tests use mock and import their helpers
        for primitive in ("mock", "test_import", "test_path"):
            found.pop(primitive, None)
    return found


def _graded_names(tests: Sequence[str]) -> tuple[str, ...]:
    """The strings that name a graded test file: its path, its dotted module, a distinctive file name."""
    out: list[str] = []
    for path in tests:
        stem = path.removesuffix(".py")
        out += [path, stem.replace("/", ".")]
        name = stem.rpartition("/")[2]
        if name not in ("test", "tests") and (name.startswith("test") or name.endswith("test")):
            out += [name + ".py", name]
    return tuple(dict.fromkeys(n for n in out if n))


# ---- what names are bound to ----

def walk(tree: ast.AST, parents: dict[int, ast.AST]) -> list[ast.AST]:
    """Every node of the tree, breadth first (as `ast.walk`), filling `parents` (id -> parent)."""
    nodes = [tree]
    for node in nodes:  # the list grows as it is read
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
            nodes.append(child)
    return nodes


def _bind(nodes: Sequence[ast.AST], ctx: _Context) -> None:
    """Import aliases, docstrings, and the names bound from sys.modules or a `__globals__`."""
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                ctx.names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                ctx.names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            ctx.inert.add(id(node.value))
    bindings = [(target, _scopes(target, ctx)[0], value) for target, value in _bindings(nodes)]
    for _ in range(4):  # aliases of aliases, names from names: a few rounds reach a fixed point in practice
        before = (len(ctx.names), len(ctx.from_modules), len(ctx.from_globals))
        for target, scope, value in bindings:
            qual = _qualname(value, ctx)
            if qual and target.id not in ctx.names:
                ctx.names[target.id] = qual
            if _rooted(value, ctx, _is_sys_modules, ctx.from_modules):
                ctx.from_modules.add((scope, target.id))
            if _rooted(value, ctx, _is_globals, ctx.from_globals):
                ctx.from_globals.add((scope, target.id))
        if (len(ctx.names), len(ctx.from_modules), len(ctx.from_globals)) == before:
            break


def _bindings(nodes: Sequence[ast.AST]) -> Iterator[tuple[ast.Name, ast.AST]]:
    """(name, the expression it is bound from): assignments, walrus, for loops, comprehensions, with."""
    for node in nodes:
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            pairs = [(node.target, node.value)]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            pairs = [(node.target, node.iter)]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            pairs = [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars is not None]
        else:
            continue
        for target, value in pairs:
            for leaf in _leaves(target):
                if isinstance(leaf, ast.Name):
                    yield leaf, value


def _scopes(node: ast.AST, ctx: _Context) -> list[int]:
    """The ids of the functions (or lambdas) a node is in, innermost first, then 0 (module level):
    names are per scope, and a nested function sees its enclosing functions' names."""
    out: list[int] = []
    for _ in range(10_000):
        node = ctx.parents.get(id(node))  # type: ignore[assignment]
        if node is None:
            break
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out.append(id(node))
    return out + [0]


def _holds(name: ast.Name, ctx: _Context, names: set[tuple[int, str]]) -> bool:
    """The name, in its scope or an enclosing one, is in `names`."""
    return any((scope, name.id) in names for scope in _scopes(name, ctx))


def _const(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _qualname(node: ast.AST, ctx: _Context) -> str:
    """The dotted name an expression stands for when it is rooted in an import ("" otherwise):
    `s._getframe` after `import sys as s` is "sys._getframe"; `vars(sys)["modules"]`,
    `sys.__dict__["modules"]`, `getattr(sys, "modules")` and `__import__("sys").modules` are
    "sys.modules"; `sys.modules["gc"]` is "gc"."""
    parts: list[str] = []
    for _ in range(MAX_CHAIN):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript) and _const(node.slice) is not None:
            inner = _namespace_of(node.value)
            if inner is not None:
                parts.append(_const(node.slice) or "")
                node = inner
            elif _qualname(node.value, ctx) == "sys.modules":
                return ".".join([_const(node.slice) or "", *reversed(parts)])
            else:
                return ""
        elif isinstance(node, ast.Call) and _called(node) == "getattr" and len(node.args) >= 2 \
                and _const(node.args[1]) is not None:
            parts.append(_const(node.args[1]) or "")
            node = node.args[0]
        elif isinstance(node, ast.Call) and _imported_module(node, ctx):
            return ".".join([_imported_module(node, ctx), *reversed(parts)])
        elif isinstance(node, ast.Name) and node.id in ctx.names:
            return ".".join([ctx.names[node.id], *reversed(parts)])
        else:
            return ""
    return ""


def _namespace_of(node: ast.AST) -> ast.AST | None:
    """X for `vars(X)` and `X.__dict__` (a subscript of them names an attribute of X)."""
    if isinstance(node, ast.Call) and _called(node) == "vars" and len(node.args) == 1:
        return node.args[0]
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    return None


def _called(call: ast.Call) -> str:
    """The bare or last dotted name of what a call calls ("" for anything else)."""
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _imported_module(call: ast.Call, ctx: _Context) -> str:
    """The module of `__import__("m")` / `importlib.import_module("m")`, "" if not one."""
    if not call.args or _const(call.args[0]) is None:
        return ""
    if _called(call) == "__import__" or _qualname(call.func, ctx) == "importlib.import_module":
        return _const(call.args[0]) or ""
    return ""


def _is_sys_modules(node: ast.AST, ctx: _Context) -> bool:
    return isinstance(node, (ast.Attribute, ast.Name, ast.Subscript, ast.Call)) and _qualname(node, ctx) == "sys.modules"


def _is_globals(node: ast.AST, ctx: _Context) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "__globals__"
    return isinstance(node, ast.Call) and _called(node) == "getattr" and len(node.args) >= 2 \
        and _const(node.args[1]) == "__globals__"


PASS_ON = frozenset({"list", "tuple", "dict", "iter", "sorted", "reversed", "vars", "getattr", "next"})
VIEWS = frozenset({"get", "values", "items", "keys", "copy", "setdefault", "pop"})


def _rooted(expr: ast.AST, ctx: _Context, test: Callable[[ast.AST, _Context], bool],
            names: set[tuple[int, str]]) -> bool:
    """`expr` reaches into what `test` accepts (or a name in `names` holds) through an access path:
    attributes, subscripts, `.get()`/`.values()`-like views, `list()`/`vars()`/`getattr()`; not through
    other calls (a value computed from a module is not the module). `sys.modules[__name__]` is the
    module's own namespace, which its code may write as it likes."""
    node = expr
    for _ in range(MAX_CHAIN):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name) and node.slice.id == "__name__" \
                and _is_sys_modules(node.value, ctx):
            return False
        if test(node, ctx) or (isinstance(node, ast.Name) and _holds(node, ctx, names)):
            return True
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in VIEWS:
            node = node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PASS_ON and node.args:
            node = node.args[0]
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):  # its items, not a new dict
            node = node.generators[0].iter
        else:
            return False
    return False


# ---- per node ----

SEEN = frozenset({ast.Name, ast.Attribute, ast.Subscript, ast.Call, ast.Import, ast.ImportFrom, ast.Constant,
                  ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete, ast.Dict, ast.ClassDef})  # the rest: nothing


def _primitives(node: ast.AST, ctx: _Context, depth: int, tests: Sequence[str]) -> list[str]:
    """The primitives one node is (an import, an attribute, a string, a call, a write, a class)."""
    if type(node) not in SEEN:
        return []
    if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)) and _is_sys_modules(node, ctx):
        return _modules_use(node, ctx)
    if isinstance(node, ast.Import):
        return [p for a in node.names if (p := _module_primitive(a.name) or _graded(a.name, ctx))]
    if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] + [a.name for a in node.names]
        return _import_from(node) or ["test_import" for n in names if _graded(n, ctx)][:1]
    if isinstance(node, ast.Attribute):
        return _attribute(node, ctx)
    if isinstance(node, ast.Subscript) and (p := _module_primitive(_qualname(node, ctx))) in ("gc", "ctypes"):
        return [p]  # sys.modules["gc"]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in ctx.inert:
        return _string(node.value, ctx)
    if isinstance(node, ast.Call):
        return _call(node, ctx, depth, tests)
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        found = [p for t in targets for leaf in _leaves(t) for p in _writes(leaf, ctx)]
        for t in targets if isinstance(node, ast.Assign) else []:  # C.__eq__ = lambda s, o: True
            if isinstance(t, ast.Attribute) and t.attr in EQ_TRUTH:
                found += ["always_equal"] * ctx.lies(node.value, t.attr)
        return found
    if isinstance(node, ast.Dict):  # type("X", (), {"__eq__": ...})
        return ["always_equal" for k, v in zip(node.keys, node.values, strict=True)
                if _const(k) in EQ_TRUTH and ctx.lies(v, _const(k) or "")]
    if isinstance(node, ast.ClassDef):
        return ["always_equal"] * sum(class_lies(node, ctx.defs, lambda n: _qualname(n, ctx)))
    return []


def _module_primitive(module: str) -> str:
    top, _, rest = module.partition(".")
    if top == "gc":
        return "gc"
    if top in ("ctypes", "_ctypes"):
        return "ctypes"
    if top == "mock" or (top == "unittest" and rest.split(".")[0] == "mock"):
        return "mock"
    if top == "unittest" and rest and (rest.split(".")[0] in UNITTEST_SUBMODULES or rest.startswith("_")):
        return "unittest_internals"
    if any(p in TEST_PARTS for p in module.split(".")):
        return "test_import"
    return ""


def _graded(module: str, ctx: _Context) -> str:
    """"test_import" for an import of a graded test module (by dotted name or its last part)."""
    return "test_import" if module and (module in ctx.graded or module.rpartition(".")[2] in ctx.graded) else ""


def _import_from(node: ast.ImportFrom) -> list[str]:
    module = node.module or ""
    if node.level:  # relative: only whether it reaches into tests
        names = [module] + [a.name for a in node.names]
        return ["test_import"] if any(p in TEST_PARTS for n in names for p in n.split(".")) else []
    found = _module_primitive(module)
    if found:
        return [found]
    out = []
    for a in node.names:
        p = ATTRS.get(a.name) or QUALNAMES.get(f"{module}.{a.name}") or _module_primitive(f"{module}.{a.name}")
        if p:
            out.append(p)
    return out


def _attribute(node: ast.Attribute, ctx: _Context) -> list[str]:
    if node.attr in ATTRS:
        return [ATTRS[node.attr]]
    qual = _qualname(node, ctx)
    if qual in QUALNAMES:
        return [QUALNAMES[qual]]
    parent = ctx.parents.get(id(node))
    if qual and not isinstance(parent, ast.Attribute) and _module_primitive(qual) in ("mock", "unittest_internals"):
        return [_module_primitive(qual)]  # `unittest.mock.ANY` once, not once per link
    return []


LOOKUPS = frozenset({"get", "__contains__", "__getitem__"})


def _modules_use(node: ast.AST, ctx: _Context) -> list[str]:
    """`sys.modules` used other than to look a module up (`[name]`, `.get(name)`, `name in`):
    iterated, copied, handed on. Item writes and write methods count as writes instead."""
    parent = ctx.parents.get(id(node))
    if isinstance(parent, ast.Subscript) and parent.value is node:
        return []
    if isinstance(parent, ast.Attribute) and parent.attr in LOOKUPS | WRITE_METHODS:
        return []
    if isinstance(parent, ast.Compare) and any(c is node and isinstance(op, (ast.In, ast.NotIn))
                                               for c, op in zip(parent.comparators, parent.ops, strict=True)):
        return []
    if isinstance(parent, ast.Call) and parent.args and parent.args[0] is node \
            and _called(parent) in WRITE_FUNCS | SETATTRS:
        return []  # counted as a write
    return ["sys_modules_walk"]


def _string(text: str, ctx: _Context) -> list[str]:
    if text in ATTRS:
        return [ATTRS[text]]
    if text.startswith("unittest.") and (p := _module_primitive(text)):
        return [p]
    if any(name in text for name in ctx.graded):
        return ["test_path"]
    return []


def _call(node: ast.Call, ctx: _Context, depth: int, tests: Sequence[str]) -> list[str]:
    found: list[str] = []
    module = _imported_module(node, ctx)
    if module and (p := _module_primitive(module)):
        found.append(p)
    name = _called(node)
    if name in SETATTRS and node.args:
        found += _writes(node.args[0], ctx, whole=True)
        if len(node.args) >= 3 and _const(node.args[1]) in EQ_TRUTH:
            found += ["always_equal"] * ctx.lies(node.args[2], _const(node.args[1]) or "")
    elif name in WRITE_FUNCS and node.args and (isinstance(node.func, ast.Name) or _is_type_method(node.func)):
        found += _writes(node.args[0], ctx, whole=True)
    elif isinstance(node.func, ast.Attribute) and name in WRITE_METHODS:
        found += _writes(node.func.value, ctx, whole=True)
    for kw in node.keywords:  # type("X", (), {...}) takes a dict; dict(__eq__=...) keywords
        if kw.arg in EQ_TRUTH:
            found += ["always_equal"] * ctx.lies(kw.value, kw.arg or "")
    if name in ("exec", "eval", "compile") and node.args and _const(node.args[0]) and depth < MAX_EXEC_DEPTH:
        found += _exec_string(_const(node.args[0]) or "", ctx, depth, tests)
    return found


def _is_type_method(func: ast.AST) -> bool:
    """`dict.update(d, ...)`, `operator.setitem(d, ...)`: a write whose object is the first argument."""
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("dict", "operator", "object", "type")


def _exec_string(source: str, ctx: _Context, depth: int, tests: Sequence[str]) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    except (RecursionError, MemoryError):
        return ["too_deep"]
    inner = count(tree, test_file=ctx.test_file, runner_repo=ctx.runner_repo, tests=tests, depth=depth + 1)
    return list(inner.elements())


def _leaves(target: ast.AST) -> Iterable[ast.AST]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _leaves(elt)
    elif isinstance(target, ast.Starred):
        yield from _leaves(target.value)
    else:
        yield target


def _writes(target: ast.AST, ctx: _Context, whole: bool = False) -> list[str]:
    """What writing `target` writes into. `whole`: `target` is the object written (setattr's first
    argument, a write method's object); otherwise an assignment target `X.a` / `X[k]` writes X."""
    if whole:
        obj = target
    elif isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Name) and target.slice.id == "__name__":
        obj = target  # `sys.modules[__name__] = X`: the lazy-module idiom replaces only the module itself
    elif isinstance(target, (ast.Attribute, ast.Subscript)):
        obj = target.value
    else:
        return []
    found = []
    if _rooted(obj, ctx, _is_sys_modules, ctx.from_modules):
        found.append("sys_modules_write")
    if _rooted(obj, ctx, _is_globals, ctx.from_globals):
        found.append("globals_write")
    if _runner_rooted(obj, ctx):
        found.append("runner_write")
    return found


def _runner_rooted(obj: ast.AST, ctx: _Context) -> bool:
    """`obj` is (an attribute of) a test runner's module or something imported from one."""
    for _ in range(MAX_CHAIN):
        if isinstance(obj, (ast.Attribute, ast.Subscript)):
            obj = obj.value
        else:
            break
    return isinstance(obj, ast.Name) and ctx.names.get(obj.id, "").split(".")[0] in RUNNER_TOPS
