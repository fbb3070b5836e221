"""Function templates, word lists and module rendering for the toy task generator (`toygen`).

Why two disjoint sets: the held-out "test" split must not be solvable by memory, so it shares
neither templates nor names with "train". A template is a function body with role placeholders
(`{x}`, `{lo}`) filled with random words, plus a generator of valid arguments; expected test
values come from running the fixed function itself, so templates carry no hand-written answers.
Arguments are drawn from small ranges so that boundaries (x == lo, b == 0) come up in the tests
and operator flips are caught.
"""

from __future__ import annotations

import ast
import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Args = Callable[[random.Random], tuple]


def _small(r: random.Random) -> int:
    return r.randint(-4, 9)


def _bounded(r: random.Random) -> tuple:
    lo = r.randint(-5, 5)
    hi = lo + r.randint(1, 6)
    return (r.randint(lo - 3, hi + 3), lo, hi)


def _list_and_value(r: random.Random) -> tuple:
    items = [r.randint(-2, 6) for _ in range(r.randint(2, 6))]
    return (items, r.choice(items + [r.randint(-2, 6)]))


def _pair(r: random.Random) -> tuple:
    return (_small(r), _small(r))


def _ordered(r: random.Random) -> tuple:
    a = r.randint(-3, 5)
    return (a, a + r.randint(0, 4))


def _text(r: random.Random) -> str:
    return "".join(r.choice("abcdeor") for _ in range(r.randint(0, 7)))


def _text_width(r: random.Random) -> tuple:
    return (_text(r), r.randint(0, 7))


def _num_den(r: random.Random) -> tuple:
    return (r.randint(0, 30), r.choice([0, 1, 2, 3, 4, 5, 7]))


def _ints(r: random.Random) -> tuple:
    return ([_small(r) for _ in range(r.randint(1, 6))],)


def _one(r: random.Random) -> tuple:
    return (r.randint(-3, 3),)


def _word_times_sep(r: random.Random) -> tuple:
    return (r.choice(["ab", "x", "hey", "zz"]), r.randint(-1, 4), r.choice(["-", ", ", "/"]))


def _one_text(r: random.Random) -> tuple:
    return (_text(r),)


@dataclass(frozen=True)
class Template:
    key: str
    params: tuple[str, ...]
    locals: tuple[str, ...]
    body: str  # indented body, placeholders {role} and {K} {C} {D} {S} {L}
    args: Args
    consts: Callable[[random.Random], dict[str, Any]] = lambda r: {}


TRAIN = [
    Template("clamp", ("x", "lo", "hi"), (), '''
    """Return {x} limited to the closed range [{lo}, {hi}]."""
    if {x} < {lo}:
        return {lo}
    if {x} > {hi}:
        return {hi}
    return {x}''', _bounded),
    Template("count_at_least", ("items", "limit"), ("n", "v"), '''
    """Count the values in {items} that are at least {limit}."""
    {n} = 0
    for {v} in {items}:
        if {v} >= {limit}:
            {n} = {n} + 1
    return {n}''', _list_and_value),
    Template("sum_multiples", ("a", "b"), ("total", "i"), '''
    """Sum {i} * {K} over every {i} from {a} to {b} inclusive."""
    {total} = 0
    for {i} in range({a}, {b} + 1):
        {total} = {total} + {i} * {K}
    return {total}''', _ordered, lambda r: {"K": r.randint(2, 5)}),
    Template("pad_cut", ("text", "width"), (), '''
    """Cut {text} to {width} characters, or pad it on the right with '{C}' up to {width}."""
    if len({text}) > {width}:
        return {text}[:{width}]
    return {text} + '{C}' * ({width} - len({text}))''', _text_width, lambda r: {"C": r.choice("._*#")}),
    Template("in_window", ("x", "lo", "hi"), (), '''
    """Whether {lo} <= {x} < {hi}."""
    return {lo} <= {x} and {x} < {hi}''', _bounded),
    Template("distance", ("a", "b"), (), '''
    """The distance between {a} and {b}, never negative."""
    if {a} > {b}:
        return {a} - {b}
    return {b} - {a}''', _pair),
    Template("safe_div", ("a", "b"), (), '''
    """{a} // {b}, or {D} when {b} is zero."""
    if {b} == 0:
        return {D}
    return {a} // {b}''', _num_den, lambda r: {"D": r.choice([-1, 1])}),
    Template("last_index", ("items", "target"), ("idx", "i", "v"), '''
    """The last position of {target} in {items}, or -1 if it is absent."""
    {idx} = -1
    for {i}, {v} in enumerate({items}):
        if {v} == {target}:
            {idx} = {i}
    return {idx}''', _list_and_value),
]

HELDOUT = [
    Template("prefix_sums", ("items",), ("out", "total", "v"), '''
    """Running totals of {items}: element k is the sum of the first k + 1 values."""
    {out} = []
    {total} = 0
    for {v} in {items}:
        {total} = {total} + {v}
        {out}.append({total})
    return {out}''', _ints),
    Template("count_chars", ("text",), ("n", "ch"), '''
    """How many characters of {text} are among '{S}'."""
    {n} = 0
    for {ch} in {text}:
        if {ch} in '{S}':
            {n} = {n} + 1
    return {n}''', _one_text, lambda r: {"S": "".join(sorted(r.sample("abcdeor", 3)))}),
    Template("sign", ("x",), (), '''
    """1 if {x} is positive, -1 if it is negative, 0 if it is zero."""
    if {x} > 0:
        return 1
    if {x} < 0:
        return -1
    return 0''', _one),
    Template("repeat_join", ("word", "times", "sep"), (), '''
    """{word} repeated {times} times, joined by {sep}; empty when {times} is not positive."""
    if {times} <= 0:
        return ''
    return {sep}.join([{word}] * {times})''', _word_times_sep),
    Template("max_rise", ("items",), ("gap", "k", "d"), '''
    """The largest rise between neighbouring values of {items}; 0 if none rises."""
    {gap} = 0
    for {k} in range(1, len({items})):
        {d} = {items}[{k}] - {items}[{k} - 1]
        if {d} > {gap}:
            {gap} = {d}
    return {gap}''', _ints),
    Template("percent", ("part", "whole"), (), '''
    """{part} as a whole-number percentage of {whole}; 0 when {whole} is zero."""
    if {whole} == 0:
        return 0
    return {part} * 100 // {whole}''', _num_den),
    Template("either_above", ("a", "b"), (), '''
    """Whether {a} and {b} differ and at least one of them is above {L}."""
    return ({a} > {L} or {b} > {L}) and {a} != {b}''', _pair, lambda r: {"L": r.randint(0, 4)}),
]

# Wrappers put distance between a failing test and the bug: {h} is the function they call.
WRAPPERS = {
    "train": [("rows", '''
    """Apply {h} to each argument tuple in {rows}."""
    {out} = []
    for {row} in {rows}:
        {out}.append({h}(*{row}))
    return {out}'''), ("same", '''
    """Describe the result of {h} as text."""
    {value} = {h}({params})
    return '{label}: ' + repr({value})''')],
    "test": [("rows", '''
    """Results of {h} for every argument tuple in {rows}."""
    return [{h}(*{row}) for {row} in {rows}]'''), ("same", '''
    """The result of {h}, keyed by its label."""
    return {{'{label}': {h}({params})}}''')],
}

WORDS = {
    "train": {
        "verbs": "clip tally gather measure settle trim weigh align fold scan grade tune press shift mark".split(),
        "nouns": ("apple river stone cloud ember maple harbor meadow copper lantern willow saddle thistle "
                  "pebble orchard canyon ferry barley").split(),
        "vars": ("amount bound ceiling level weight quota margin stock crate parcel bucket cargo load "
                 "ticket badge ribbon basket acorn rows_in").split(),
        "modules": ("core", "api"),
    },
    "test": {
        "verbs": "probe rank sift forge chart blend hatch mend stitch steer brew carve".split(),
        "nouns": ("quartz falcon glacier nebula raven tundra comet basalt cobalt fjord lagoon sparrow "
                  "walnut cinder prism dune").split(),
        "vars": ("datum figure entry sample reading piece unit slot cell point span grain chunk node tile "
                 "shard crumb speck").split(),
        "modules": ("base", "service"),
    },
}


@dataclass
class TestSpec:
    id: str  # unittest id: tests.test_mod.TestX.test_y
    cases: list[tuple[tuple, Any]]  # (args, expected)


@dataclass
class Func:
    name: str
    path: str  # file, e.g. applekit/core.py
    module: str  # dotted, e.g. applekit.core
    node: ast.FunctionDef  # the fixed function
    args: Args
    target: bool = False  # a bug goes here
    public: bool = True  # tested directly
    tests: list[TestSpec] = field(default_factory=list)


def _fill(name: str, params: list[str], body: str, values: dict[str, Any]) -> ast.FunctionDef:
    src = f"def {name}({', '.join(params)}):" + body.format(**values)
    return ast.parse(src).body[0]  # type: ignore[return-value]


def _base_func(rng: random.Random, tpl: Template, name: str, words: list[str], path: str) -> Func:
    names = dict(zip(tpl.params + tpl.locals, rng.sample(words, len(tpl.params) + len(tpl.locals)), strict=False))
    node = _fill(name, [names[p] for p in tpl.params], tpl.body, {**names, **tpl.consts(rng)})
    return Func(name, path, path[:-3].replace("/", "."), node, tpl.args)


def _wrapper(rng: random.Random, split: str, inner: Func, name: str, words: list[str], path: str,
             batch: bool = True) -> Func:
    """A function calling `inner`: per row of a batch ("rows") or with the same arguments ("same")."""
    kind, body = rng.choice([w for w in WRAPPERS[split] if batch or w[0] != "rows"])
    n_params = len(inner.node.args.args)
    picked = rng.sample(words, n_params + 3)
    rows, out, row = picked[-3:]
    params = [rows] if kind == "rows" else picked[:n_params]
    values = {"h": inner.name, "rows": rows, "out": out, "row": row, "value": row,
              "label": inner.name.strip("_"), "params": ", ".join(params)}
    args: Args = (lambda r, g=inner.args: ([g(r) for _ in range(3)],)) if kind == "rows" else inner.args
    return Func(name, path, path[:-3].replace("/", "."), _fill(name, params, body, values), args)


def make_module(rng: random.Random, split: str, n_targets: int, depth: int):
    """Functions of a new package: targets (to be bugged) behind `depth - 1` wrappers each.

    Returns (package, funcs, render) where render(overrides) gives {path: text} for every file,
    with the functions named in `overrides` replaced by the given (mutated) nodes.
    """
    words = WORDS[split]
    templates = TRAIN if split == "train" else HELDOUT
    pkg = rng.choice(words["nouns"]) + rng.choice(["kit", "lib", "tools", "utils"])
    core, outer = (f"{pkg}/{m}.py" for m in words["modules"])
    names = rng.sample([f"{v}_{n}" for v in words["verbs"] for n in words["nouns"]], 16)
    funcs: list[Func] = []
    n_funcs = rng.randint(max(4, n_targets + 2), 6)
    for k in range(n_funcs):
        fn = _base_func(rng, rng.choice(templates), names.pop(), words["vars"], core)
        fn.target = k < n_targets
        funcs.append(fn)
        chain = fn
        for _ in range(depth - 1 if fn.target else 0):  # a batch of batches makes unreadable tests
            chain.public = False
            _rename(chain, "_" + chain.name)
            batch = chain.args is fn.args
            chain = _wrapper(rng, split, chain, names.pop(), words["vars"], outer, batch)
            funcs.append(chain)
    rng.shuffle(funcs)
    for fn in funcs:
        if fn.public:
            _add_tests(rng, fn, funcs)
    return pkg, funcs, lambda overrides: render(pkg, funcs, overrides)


def _rename(fn: Func, name: str) -> None:
    fn.name = name
    fn.node.name = name


def namespace(funcs: list[Func], overrides: dict[str, ast.FunctionDef]) -> dict[str, Any]:
    """Every function defined in one dict: the in-process stand-in for importing the package."""
    ns: dict[str, Any] = {}
    mod = ast.Module(body=[overrides.get(f.name, f.node) for f in funcs], type_ignores=[])
    exec(compile(ast.fix_missing_locations(copy.deepcopy(mod)), "<toy>", "exec"), ns)
    return ns


def _add_tests(rng: random.Random, fn: Func, funcs: list[Func]) -> None:
    """Two or three test methods of two or three cases, expected values from the fixed code."""
    ns = namespace(funcs, {})
    stem = fn.path.rsplit("/", 1)[1][:-3]
    cls = "Test" + "".join(p.capitalize() for p in fn.name.split("_"))
    methods = rng.sample(["basic", "small", "mixed", "edges", "more", "spread", "usual"], rng.randint(2, 3))
    for m in methods:
        cases = []
        for _ in range(rng.randint(2, 3)):
            args = fn.args(rng)
            cases.append((args, ns[fn.name](*copy.deepcopy(args))))
        fn.tests.append(TestSpec(f"tests.test_{stem}.{cls}.test_{m}", cases))


def render(pkg: str, funcs: list[Func], overrides: dict[str, ast.FunctionDef]) -> dict[str, str]:
    """All files of the repository, code sorted by file, tests one class per public function."""
    files: dict[str, str] = {f"{pkg}/__init__.py": "", "tests/__init__.py": "",
                             ".gitignore": "__pycache__/\n*.pyc\n",
                             "README.md": f"# {pkg}\n\nSmall utilities. Tests: `python3 -m unittest -v`.\n"}
    for path in sorted({f.path for f in funcs}):
        mine = [f for f in funcs if f.path == path]
        used = sorted({n.id for f in mine for n in ast.walk(f.node) if isinstance(n, ast.Name)}
                      & {f.name for f in funcs if f.path != path})
        imports = [f"from {funcs_module(funcs, used[0])} import {', '.join(used)}"] if used else []
        code = "\n\n\n".join(ast.unparse(overrides.get(f.name, f.node)) for f in mine)
        files[path] = "\n".join(['"""Small utilities."""', *imports]) + "\n\n\n" + code + "\n"
        if any(f.public for f in mine):
            files[_test_path(path)] = _test_file(mine)
    return files


def funcs_module(funcs: list[Func], name: str) -> str:
    return next(f.module for f in funcs if f.name == name)


def _test_path(path: str) -> str:
    return "tests/test_" + path.rsplit("/", 1)[1]


def _test_file(funcs: list[Func]) -> str:
    public = [f for f in funcs if f.public]
    lines = ["import unittest\n\n", f"from {funcs[0].module} import {', '.join(f.name for f in public)}\n"]
    for fn in public:
        lines.append(f"\n\nclass {fn.tests[0].id.split('.')[2]}(unittest.TestCase):\n")
        for test in fn.tests:
            lines.append(f"\n    def {test.id.rsplit('.', 1)[1]}(self):\n")
            for args, expected in test.cases:
                call = f"{fn.name}({', '.join(repr(a) for a in args)})"
                lines.append(f"        self.assertEqual({call}, {expected!r})\n")
    lines.append("\n\nif __name__ == '__main__':\n    unittest.main()\n")
    return "".join(lines)
