"""Templates of one-function Python problems: a docstring, a reference body, inputs to test with.

Why templates with varied names, argument names and constants: a few hundred distinct tasks from a
few dozen ideas, each small enough for a 270M base model to get right sometimes (about a third of
samples, measured: GRPO needs groups that disagree), with hidden tests the grader runs. The held-out
split keeps whole templates out of training (`held_out`) and draws every constant from a range
training never sees (`TRAIN_CONSTS` / `TEST_CONSTS`), so a lift on it is generalisation, not memory.

A template's `doc` and `body` are format strings over the argument names (`a`, `b`) and the
constants (`c`: a small integer, `ch`: a letter, `k`: a dict key); `inputs` names how test
arguments are drawn. A body is one line or several (joined by "\n    ", the function's indent).
Some references raise a builtin exception for some inputs, as their docstring says; such a case
expects that exception (`Raises`), by type name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

TRAIN_CONSTS = (2, 3, 4, 5, 6, 7)
TEST_CONSTS = (8, 9, 11, 12, 13)
TRAIN_LETTERS = tuple("abcdefghijklm")
TEST_LETTERS = tuple("nopqrstuvwxyz")
TRAIN_KEYS = ("apple", "blue", "cat", "door", "east")
TEST_KEYS = ("north", "pear", "red", "stone", "west")
WORDS = ("banana", "cherry", "kiwi", "mango", "papaya", "river", "stone", "zebra", "garden", "letter", "")


@dataclass(frozen=True)
class FunctionTemplate:
    key: str
    category: str
    names: tuple[str, ...]  # function names (may use {c} / {ch})
    args: tuple[tuple[str, ...], ...]  # argument name choices, one tuple per choice
    doc: str
    body: str
    inputs: str  # "int", "int2", "str", "ints", "dict"
    held_out: bool = False


TEMPLATES: tuple[FunctionTemplate, ...] = (
    # arithmetic
    FunctionTemplate("mul_const", "arith", ("times_{c}", "scale_by_{c}", "multiply_by_{c}"), (("x",), ("n",), ("value",)),
             "Return {a} multiplied by {c}.", "return {a} * {c}", "int"),
    FunctionTemplate("add_const", "arith", ("add_{c}", "plus_{c}", "increase_by_{c}"), (("x",), ("n",), ("count",)),
             "Return {a} plus {c}.", "return {a} + {c}", "int"),
    FunctionTemplate("sub_pair", "arith", ("subtract", "difference", "minus"), (("a", "b"), ("x", "y"), ("first", "second")),
             "Return {a} minus {b}.", "return {a} - {b}", "int2"),
    FunctionTemplate("max_pair", "arith", ("larger", "maximum", "bigger_of"), (("a", "b"), ("x", "y"), ("left", "right")),
             "Return the larger of {a} and {b}.", "return max({a}, {b})", "int2"),
    FunctionTemplate("square_plus", "arith", ("square_plus_{c}", "squared_and_{c}"), (("x",), ("n",)),
             "Return the square of {a} plus {c}.", "return {a} * {a} + {c}", "int", held_out=True),
    # conditions
    FunctionTemplate("is_even", "cond", ("is_even", "even", "check_even"), (("n",), ("x",), ("number",)),
             "Return True if {a} is even, otherwise False.", "return {a} % 2 == 0", "int"),
    FunctionTemplate("divisible", "cond", ("divisible_by_{c}", "is_multiple_of_{c}"), (("n",), ("x",), ("number",)),
             "Return True if {a} is divisible by {c}, otherwise False.", "return {a} % {c} == 0", "int"),
    FunctionTemplate("clamp_max", "cond", ("at_most_{c}", "cap_at_{c}", "limit_{c}"), (("x",), ("n",), ("value",)),
             "Return {a}, but never more than {c}.", "return min({a}, {c})", "int"),
    FunctionTemplate("far_apart", "cond", ("far_apart", "differ_by_more_than_{c}"), (("a", "b"), ("x", "y")),
             "Return True if {a} and {b} differ by more than {c}, otherwise False.", "return abs({a} - {b}) > {c}",
             "int2"),
    FunctionTemplate("checked_scale", "cond", ("checked_times_{c}", "scale_nonnegative_{c}"), (("x",), ("n",), ("value",)),
             "Return {a} multiplied by {c}. Raise ValueError if {a} is negative.",
             "if {a} < 0:\n        raise ValueError('negative')\n    return {a} * {c}", "int"),
    FunctionTemplate("sign", "cond", ("sign", "sign_of"), (("x",), ("n",)),
             "Return 1 if {a} is positive, -1 if it is negative and 0 if it is zero.",
             "return (({a} > 0) - ({a} < 0))", "int", held_out=True),
    # strings
    FunctionTemplate("repeat", "str", ("repeat_{c}", "copies_{c}"), (("s",), ("text",), ("word",)),
             "Return the string {a} repeated {c} times.", "return {a} * {c}", "str"),
    FunctionTemplate("count_letter", "str", ("count_{ch}", "number_of_{ch}"), (("s",), ("text",), ("word",)),
             "Return how many times the letter '{ch}' appears in {a}.", "return {a}.count('{ch}')", "str"),
    FunctionTemplate("prefix", "str", ("first_{c}", "head_{c}"), (("s",), ("text",), ("word",)),
             "Return the first {c} characters of {a}.", "return {a}[:{c}]", "str"),
    FunctionTemplate("upper", "str", ("shout", "to_upper", "upper_case"), (("s",), ("text",), ("word",)),
             "Return {a} in upper case.", "return {a}.upper()", "str"),
    FunctionTemplate("starts_with", "str", ("starts_with_{ch}", "begins_with_{ch}"), (("s",), ("text",), ("word",)),
             "Return True if {a} starts with the letter '{ch}', otherwise False.", "return {a}.startswith('{ch}')",
             "str"),
    FunctionTemplate("reverse", "str", ("reverse", "backwards"), (("s",), ("text",)),
             "Return the string {a} reversed.", "return {a}[::-1]", "str", held_out=True),
    # lists
    FunctionTemplate("last", "list", ("last", "last_item", "final_element"), (("xs",), ("items",), ("values",)),
             "Return the last element of the list {a}.", "return {a}[-1]", "ints"),
    FunctionTemplate("sum_squares", "list", ("sum_of_squares", "square_sum"), (("xs",), ("numbers",), ("values",)),
             "Return the sum of the squares of the numbers in {a}.", "return sum(v * v for v in {a})", "ints"),
    FunctionTemplate("count_above", "list", ("count_above_{c}", "how_many_over_{c}"), (("xs",), ("numbers",), ("values",)),
             "Return how many numbers in {a} are greater than {c}.", "return sum(1 for v in {a} if v > {c})", "ints"),
    FunctionTemplate("add_each", "list", ("add_{c}_to_each", "shift_by_{c}"), (("xs",), ("numbers",), ("values",)),
             "Return a new list with {c} added to each number in {a}.", "return [v + {c} for v in {a}]", "ints"),
    FunctionTemplate("evens", "list", ("evens", "only_even"), (("xs",), ("numbers",)),
             "Return a list of the even numbers in {a}, in their order.", "return [v for v in {a} if v % 2 == 0]",
             "ints", held_out=True),
    # dicts
    FunctionTemplate("get_default", "dict", ("lookup_{k}", "value_of_{k}"), (("d",), ("table",), ("counts",)),
             "Return the value stored under the key '{k}' in the dict {a}, or {c} if the key is missing.",
             "return {a}.get('{k}', {c})", "dict"),
    FunctionTemplate("num_keys", "dict", ("num_keys", "size", "count_keys"), (("d",), ("table",), ("counts",)),
             "Return the number of keys in the dict {a}.", "return len({a})", "dict"),
    FunctionTemplate("has_key", "dict", ("has_{k}", "contains_{k}"), (("d",), ("table",), ("counts",)),
             "Return True if the dict {a} has the key '{k}', otherwise False.", "return '{k}' in {a}", "dict"),
    FunctionTemplate("get_strict", "dict", ("require_{k}", "strict_{k}"), (("d",), ("table",), ("counts",)),
             "Return the value stored under the key '{k}' in the dict {a}. Raise KeyError if the key is missing.",
             "return {a}['{k}']", "dict"),
    FunctionTemplate("sum_values", "dict", ("total", "sum_values"), (("d",), ("counts",)),
             "Return the sum of the values in the dict {a}.", "return sum({a}.values())", "dict", held_out=True),
)

# Another correct body per template: the hidden tests must accept it too (`tasks check` grades it),
# so a test that pins one way of writing the answer shows up as a flawed task.
VARIANTS = {
    "mul_const": "return {c} * {a}", "add_const": "return {c} + {a}", "sub_pair": "return -({b} - {a})",
    "max_pair": "return {a} if {a} >= {b} else {b}", "square_plus": "return {a} ** 2 + {c}",
    "is_even": "return not {a} % 2", "divisible": "return not {a} % {c}",
    "clamp_max": "return {a} if {a} < {c} else {c}", "far_apart": "return {a} - {b} > {c} or {b} - {a} > {c}",
    "sign": "return 0 if {a} == 0 else (1 if {a} > 0 else -1)", "repeat": "return ''.join({a} for _ in range({c}))",
    "count_letter": "return sum(1 for x_ in {a} if x_ == '{ch}')", "prefix": "return {a}[0:{c}]",
    "upper": "return ''.join(x_.upper() for x_ in {a})", "starts_with": "return {a}[:1] == '{ch}'",
    "reverse": "return ''.join(reversed({a}))", "last": "return {a}[len({a}) - 1]",
    "sum_squares": "return sum([v ** 2 for v in {a}])", "count_above": "return len([v for v in {a} if v > {c}])",
    "add_each": "return list(map(lambda v: v + {c}, {a}))", "evens": "return list(filter(lambda v: v % 2 == 0, {a}))",
    "get_default": "return {a}['{k}'] if '{k}' in {a} else {c}", "num_keys": "return len({a}.keys())",
    "has_key": "return {a}.get('{k}') is not None", "sum_values": "return sum(v for v in {a}.values())",
    "checked_scale": "if {a} >= 0:\n        return {c} * {a}\n    raise ValueError({a})",
    "get_strict": "if '{k}' not in {a}:\n        raise KeyError('{k}')\n    return {a}['{k}']",
}


@dataclass(frozen=True)
class Raises:
    """An expected result that is an exception: the reference raised a builtin exception of this type."""

    name: str


@dataclass(frozen=True)
class Problem:
    """One concrete function to write: its source stub, reference and test cases."""

    template: str
    name: str
    args: tuple[str, ...]
    doc: str
    body: str  # the reference body (its first line without indent; "\n    " between lines)
    variant: str  # another correct body ("" if none)
    cases: tuple[tuple[tuple[Any, ...], Any], ...]  # (arguments, expected result or Raises)

    @property
    def signature(self) -> str:
        return f"def {self.name}({', '.join(self.args)}):"

    @property
    def prompt(self) -> str:
        """What the model continues: the def line and its docstring (a completion, not a chat)."""
        return f'{self.signature}\n    """{self.doc}"""\n'

    @property
    def solution(self) -> str:
        return f"{self.prompt}    {self.body}\n"

    @property
    def variant_solution(self) -> str:
        return f"{self.prompt}    {self.variant}\n" if self.variant else ""


def make_problem(t: FunctionTemplate, rng: random.Random, test_consts: bool, n_cases: int = 5) -> Problem:
    """A concrete problem of template `t`: names, argument names and constants drawn from `rng`
    (constants from the held-out ranges when `test_consts`); expected results from the reference."""
    c = rng.choice(TEST_CONSTS if test_consts else TRAIN_CONSTS)
    ch = rng.choice(TEST_LETTERS if test_consts else TRAIN_LETTERS)
    k = rng.choice(TEST_KEYS if test_consts else TRAIN_KEYS)
    args = rng.choice(t.args)
    names = {"c": c, "ch": ch, "k": k, "a": args[0], "b": args[1] if len(args) > 1 else ""}
    name = rng.choice(t.names).format(**names)
    body = t.body.format(**names)
    ref = _compile(name, args, body)
    cases = []
    for _ in range(50):
        if len(cases) == n_cases:
            break
        call = _inputs(t.inputs, rng, ch, k)
        if any(call == seen for seen, _ in cases):
            continue
        cases.append((call, _expected(ref, call)))
    variant = VARIANTS.get(t.key, "").format(**names)
    return Problem(t.key, name, args, t.doc.format(**names), body, variant, tuple(cases))


def _expected(ref: Any, call: tuple[Any, ...]) -> Any:
    """What the reference returns for `call`, or `Raises` of the builtin exception it raised."""
    try:
        return ref(*call)
    except Exception as exc:  # the template's own reference: its exceptions are the documented ones
        return Raises(type(exc).__name__)


def _compile(name: str, args: tuple[str, ...], body: str) -> Any:
    scope: dict[str, Any] = {}
    exec(f"def {name}({', '.join(args)}):\n    {body}\n", scope)  # the template's own reference, not model code
    return scope[name]


def _inputs(kind: str, rng: random.Random, ch: str, k: str) -> tuple[Any, ...]:
    if kind == "int":
        return (rng.randint(-20, 40),)
    if kind == "int2":
        return (rng.randint(-20, 40), rng.randint(-20, 40))
    if kind == "str":
        word = rng.choice(WORDS)
        return (rng.choice((word, ch + word, word + ch * rng.randint(1, 3), word.upper())),)
    if kind == "ints":
        return ([rng.randint(-9, 15) for _ in range(rng.randint(1, 6))],)
    if kind == "dict":
        keys = rng.sample([*TRAIN_KEYS, *TEST_KEYS], rng.randint(0, 4))
        if rng.random() < 0.5 and k not in keys:
            keys.append(k)
        return ({key: rng.randint(0, 30) for key in keys},)
    raise ValueError(f"unknown input kind {kind!r}")
