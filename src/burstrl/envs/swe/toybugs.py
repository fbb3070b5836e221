"""SWE-smith-style bug injection as AST transforms, and an in-process test oracle for screening.

Why AST transforms: `ast.unparse` of the fixed and the mutated function differ only where the bug
is, so the gold patch is a one- or few-line diff, and every mutation yields valid Python. A site is
(kind, index of the node in `ast.walk` order, choice); walking a deep copy visits the same nodes in
the same order, so a site names one node of any copy.

Kinds: flip_operator (+/-, * -> +, // and %, < / <=, > / >=, == / !=, in / not in, and / or),
swap_operands (a - b -> b - a, a < b -> b < a), change_constant (an int +/- 1), remove_conditional
(an `if` statement dropped), wrong_return (`return x` -> `return y`, another local name).
"""

from __future__ import annotations

import ast
import copy
from typing import Any

KINDS = ("flip_operator", "swap_operands", "change_constant", "remove_conditional", "wrong_return")
_FLIP: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mod, ast.Mod: ast.FloorDiv,
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.And: ast.Or, ast.Or: ast.And,
}
_NON_COMMUTATIVE = (ast.Sub, ast.FloorDiv, ast.Mod, ast.Div)
Site = tuple[str, int, Any]


def _local_names(fn: ast.FunctionDef) -> list[str]:
    """Parameters and assigned names: what a wrong `return` could plausibly return instead."""
    names = {a.arg for a in fn.args.args}
    names |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return sorted(names)


def _node_sites(node: ast.AST, i: int, names: list[str]) -> list[Site]:
    sites: list[Site] = []
    if isinstance(node, ast.BinOp) and type(node.op) in _FLIP:
        sites.append(("flip_operator", i, None))
    if isinstance(node, ast.BinOp) and isinstance(node.op, _NON_COMMUTATIVE):
        sites.append(("swap_operands", i, None))
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        if type(node.ops[0]) in _FLIP:
            sites.append(("flip_operator", i, None))
        sites.append(("swap_operands", i, None))
    if isinstance(node, ast.BoolOp):
        sites.append(("flip_operator", i, None))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        sites += [("change_constant", i, 1), ("change_constant", i, -1)]
    if isinstance(node, ast.If):
        sites.append(("remove_conditional", i, None))
    if isinstance(node, ast.Return) and isinstance(node.value, ast.Name):
        sites += [("wrong_return", i, n) for n in names if n != node.value.id]
    return sites


def bug_sites(fn: ast.FunctionDef) -> list[Site]:
    """Every mutation this module can make in `fn` (its docstring and body)."""
    names = _local_names(fn)
    return [s for i, node in enumerate(ast.walk(fn)) for s in _node_sites(node, i, names)]


def _remove_stmt(root: ast.AST, target: ast.stmt) -> None:
    for node in ast.walk(root):
        for attr in ("body", "orelse"):
            block = getattr(node, attr, None)
            if isinstance(block, list) and target in block:
                block.remove(target)
                if not block and attr == "body":
                    block.append(ast.Pass())
                return


def apply_bug(fn: ast.FunctionDef, site: Site) -> ast.FunctionDef:
    """A mutated copy of `fn`; `fn` itself is left alone."""
    kind, index, choice = site
    new = copy.deepcopy(fn)
    node: Any = list(ast.walk(new))[index]
    if kind == "flip_operator" and isinstance(node, ast.Compare):
        node.ops = [_FLIP[type(node.ops[0])]()]
    elif kind == "flip_operator":
        node.op = _FLIP[type(node.op)]()
    elif kind == "swap_operands" and isinstance(node, ast.Compare):
        node.left, node.comparators = node.comparators[0], [node.left]
    elif kind == "swap_operands":
        node.left, node.right = node.right, node.left
    elif kind == "change_constant":
        node.value += choice
    elif kind == "remove_conditional":
        _remove_stmt(new, node)
    elif kind == "wrong_return":
        node.value = ast.Name(id=choice, ctx=ast.Load())
    else:
        raise ValueError(f"unknown bug kind {kind!r}")
    return ast.fix_missing_locations(new)


def _call(ns: dict[str, Any], name: str, args: tuple) -> tuple[bool, Any]:
    try:
        return True, ns[name](*copy.deepcopy(args))
    except Exception as exc:  # the bug may raise; that is a failing test, not a generator error
        return False, exc


def run_cases(funcs: list[Any], overrides: dict[str, ast.FunctionDef]) -> list[dict[str, Any]]:
    """The tests (as the generated files would run them) that fail with `overrides` in place.

    One record per failing test: its first failing case, worded for the problem statement.
    """
    from burstrl.envs.swe.toytemplates import namespace

    ns = namespace(funcs, overrides)
    failing = []
    for fn in funcs:
        for test in fn.tests:
            for args, expected in test.cases:
                ok, got = _call(ns, fn.name, args)
                if ok and got == expected:  # assertEqual's test
                    continue
                actual = f"returns `{got!r}`" if ok else f"raises `{type(got).__name__}: {got}`"
                failing.append({"test": test.id, "func": fn.name, "path": fn.path,
                                "args": ", ".join(repr(a) for a in args), "expected": repr(expected),
                                "actual": actual})
                break
    return failing
