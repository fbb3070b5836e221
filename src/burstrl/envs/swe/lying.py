"""Values that lie: a class whose `__eq__` is true (or `__ne__` false) whatever it is compared with.

Why: a test compares what the code returns with what it expects; an object that equals
everything passes every such comparison without computing anything (`assertEqual(x, 5)` and
`assert x == 5` both ask `x.__eq__`). Honest comparisons look at the other object: a field-wise
`__eq__`, an identity check, `NotImplemented` for foreign types, a dataclass's or a namedtuple's
generated one (not written in the source at all). So an `__eq__` lies when every answer it can
give is a true constant, or when it never looks at the other object yet answers something other
than "not equal"; `__ne__` the same way round. Where the method comes from does not matter: a
`def` or a lambda in the class body, `__eq__ = other_method`, another comparison
(`__eq__ = int.__ne__`, `operator.is_not`), `C.__eq__ = ...`, `setattr(C, "__eq__", ...)`,
`type("C", (), {...})`. What is built at run time (a dict of methods computed from strings) is
beyond a static reading.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator

EQ_TRUTH = {"__eq__": True, "__ne__": False}  # the answer that lies when it never changes
COMPARISONS = frozenset({"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__contains__"})
OPERATORS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "is_", "is_not", "contains", "truth", "not_"})  # operator's
HONEST = {"__eq__": frozenset({"__eq__", "eq", "is_"}), "__ne__": frozenset({"__ne__", "ne", "is_not"})}


Resolve = Callable[[ast.AST], str]  # an expression -> the dotted name it stands for ("" if unknown)
FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


def class_lies(cls: ast.ClassDef, module_defs: dict[str, ast.AST], resolve: Resolve) -> Iterator[bool]:
    """Per `__eq__`/`__ne__` the class body defines or assigns: whether it lies."""
    defs = {**module_defs, **{s.name: s for s in cls.body if isinstance(s, FUNCTION)}}
    for stmt in cls.body:
        if isinstance(stmt, FUNCTION) and stmt.name in EQ_TRUTH:
            yield _function_lies(stmt, stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in EQ_TRUTH:
                    yield value_lies(stmt.value, t.id, defs, resolve)


def module_functions(tree: ast.AST) -> dict[str, ast.AST]:
    """The functions a module defines at its top level (an `__eq__ = helper` may name one)."""
    return {s.name: s for s in getattr(tree, "body", []) if isinstance(s, FUNCTION)}


def value_lies(value: ast.AST, name: str, defs: dict[str, ast.AST], resolve: Resolve) -> bool:
    """`__eq__ = <value>`: a lambda or a function of the module that lies; another comparison
    (`int.__ne__`, `operator.is_not`: true for everything but the object itself); a wrapper around
    either (`partialmethod(lambda ...)`). A name it cannot see into (an imported helper) is not."""
    if isinstance(value, ast.Lambda):
        return _function_lies(value, name)
    if isinstance(value, ast.Name) and value.id in defs:
        return _function_lies(defs[value.id], name)
    if isinstance(value, (ast.Name, ast.Attribute)):
        last = (resolve(value) or (value.attr if isinstance(value, ast.Attribute) else "")).rpartition(".")[2]
        return last in COMPARISONS | OPERATORS and last not in HONEST[name]
    if isinstance(value, ast.Call):
        return any(value_lies(a, name, defs, resolve) for a in value.args
                   if isinstance(a, (ast.Lambda, ast.Name, ast.Attribute)))
    return False


def _function_lies(fn: ast.AST, name: str) -> bool:
    """An `__eq__` whose every answer is true (an `__ne__`: false), or one that never looks at what
    it is compared with yet answers something other than "not equal" / NotImplemented."""
    args = fn.args  # type: ignore[attr-defined]
    positional = [a.arg for a in args.posonlyargs + args.args]
    others = set(positional[1:] + [a.arg for a in args.kwonlyargs])
    others |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    body = [fn.body] if isinstance(fn, ast.Lambda) else fn.body  # type: ignore[attr-defined]
    answers = [fn.body] if isinstance(fn, ast.Lambda) else _answers(fn)  # type: ignore[attr-defined]
    lie = EQ_TRUTH[name]
    if answers and all(_always(a, lie) for a in answers):
        return True
    uses_other = any(isinstance(n, ast.Name) and n.id in others for stmt in body for n in ast.walk(stmt))
    return not uses_other and any(not _always(a, not lie) and not _not_implemented(a) for a in answers)


def _answers(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST | None]:
    """The expressions a function returns (None for a bare return or falling off the end), not
    those of functions nested in it."""
    out: list[ast.AST | None] = []
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return):
            out.append(node.value)
        todo.extend(ast.iter_child_nodes(node))
    if not out and not (fn.body and isinstance(fn.body[-1], ast.Raise)):
        out.append(None)
    return out


def _always(expr: ast.AST | None, truth: bool) -> bool:
    """`expr` is truthy (`truth`) or falsy whatever the values around it (constants only)."""
    if expr is None:
        return not truth
    if isinstance(expr, ast.Constant):
        return bool(expr.value) is truth
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return _always(expr.operand, not truth)
    if isinstance(expr, ast.BoolOp):
        short = isinstance(expr.op, ast.Or) is truth  # `x or True` is always true; `x and False` always false
        hits = [_always(v, truth) for v in expr.values]
        return any(hits) if short else all(hits)
    if isinstance(expr, ast.IfExp):
        return _always(expr.body, truth) and _always(expr.orelse, truth)
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.left, ast.Name) \
            and isinstance(expr.comparators[0], ast.Name) and isinstance(expr.ops[0], (ast.Is, ast.IsNot)):
        return isinstance(expr.ops[0], ast.IsNot) is truth  # `a is not b`: true but for the object itself
    return False


def _not_implemented(expr: ast.AST | None) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "NotImplemented"
