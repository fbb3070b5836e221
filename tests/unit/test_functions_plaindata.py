"""The plain-data channel of functions grading (issue 48): exact-type encoding, and a strict, bounded
decoder that never raises anything but PlainDataError, however hostile its input."""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any
from unittest import mock

import pytest

from burstrl.envs.functions import plaindata
from burstrl.envs.functions.plaindata import PlainDataError, dumps, encode, loads

VALUES: list[Any] = [
    None, True, False, 0, -1, 2 ** 1000, -(10 ** 3999), 0.5, -0.0, 1e308, float("inf"), float("-inf"), 1.5e-07,
    "", "naïve ☃ 🐍", "\ud800", "a\nb\"c\\", b"", b"\x00\xff", [], (), set(), frozenset(), {},
    [1, [2, [3, (4, {5: "x"})]]], (1, "a", None), {1, 2, 3}, frozenset({"a", (1, 2)}),
    {"a": 1, (1, 2): [3], frozenset({1}): {"b": None}, None: b"x", 1.5: True},
]


@pytest.mark.parametrize("value", VALUES, ids=[f"{i}-{type(v).__name__}" for i, v in enumerate(VALUES)])  # a set's
# repr depends on hash randomization: ids must not, or xdist workers collect different tests
def test_plain_values_round_trip_exactly(value: Any) -> None:
    back = loads(dumps(value))
    assert back == value and type(back) is type(value)
    assert shape(back) == shape(value)  # -0.0 keeps its sign, containers their element types
    assert "\n" not in dumps(value)  # one line whatever the strings hold


def shape(value: Any) -> Any:
    """Every element's type and repr, with sets and dicts in a sorted order (a set's repr follows
    hash randomization and insertion order: two equal frozensets may print differently)."""
    if isinstance(value, (set, frozenset)):
        return type(value).__name__, sorted(repr(shape(v)) for v in value)
    if isinstance(value, dict):
        return "dict", sorted(repr((shape(k), shape(v))) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [shape(v) for v in value]
    return type(value).__name__, repr(value)


def test_nan_round_trips_as_nan() -> None:
    assert math.isnan(loads(dumps(float("nan"))))


class LyingStr(str):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


class LyingInt(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


class LyingTuple(tuple):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = tuple.__hash__


class LyingClass:
    __class__ = property(lambda self: int)  # type: ignore[assignment]  # isinstance(x, int) holds

    def __eq__(self, other: object) -> bool:
        return True


@pytest.mark.parametrize("value", [LyingStr("x"), LyingInt(1), LyingTuple(), LyingClass(), mock.ANY, mock.MagicMock(),
                                   object(), len, iter([]), range(3), {}.keys(), [mock.ANY], (1, LyingInt(2)),
                                   {"k": mock.ANY}, {LyingStr("k"): 1}, bytearray(b"x")],
                         ids=lambda v: type(v).__name__)
def test_anything_but_exact_builtins_has_no_encoding(value: Any) -> None:
    assert isinstance(LyingClass(), int)  # why the checks are `type(x) is`, never isinstance
    with pytest.raises(PlainDataError):
        encode(value)


def nested(depth: int) -> list[Any]:
    x: list[Any] = []
    for _ in range(depth):
        x = [x]
    return x


def test_bounds_are_enforced_on_both_sides() -> None:
    looped: list[Any] = []
    looped.append(looped)
    too_big = [nested(plaindata.MAX_DEPTH + 1), looped, list(range(plaindata.MAX_NODES + 1)),
               set(range(plaindata.MAX_HASHED + 1)), "x" * (plaindata.MAX_CHARS + 1), b"x" * (plaindata.MAX_CHARS + 1),
               10 ** plaindata.MAX_INT_DIGITS, 7 ** 100000, ["x" * 60000] * 5]
    for value in too_big:
        with pytest.raises(PlainDataError):
            dumps(value)
    dumps(nested(plaindata.MAX_DEPTH))  # the bounds themselves are fine
    deep = json.dumps(_tagged_nest(plaindata.MAX_DEPTH + 1))
    wide = json.dumps(["list", [["none"]] * (plaindata.MAX_NODES + 1)])
    for text in (deep, wide, '["int","1' + "0" * plaindata.MAX_INT_DIGITS + '"]', '["str","' + "x" * 70000 + '"]'):
        with pytest.raises(PlainDataError):
            loads(text)


def _tagged_nest(depth: int) -> list[Any]:
    node: list[Any] = ["list", []]
    for _ in range(depth):
        node = ["list", [node]]
    return node


@pytest.mark.parametrize("text", [
    "", "null", "[]", '["none", 1]', '["bool", 1]', '["int", 1]', '["int", "01"]', '["int", "-0"]', '["int", "1e3"]',
    '["int", " 1"]', '["float", "1"]', '["float", "0x1p3"]', '["float", "infinity"]', '["float", 1.5]',
    '["str", 5]', '["bytes", "ABCD"]', '["bytes", "abc"]', '["list", {}]', '["dict", [[["none"]]]]',
    '["dict", [[["list", []], ["none"]]]]', '["set", [["list", []]]]', '["tuple"]', '["Tuple", []]', '["x", []]',
    '{"a": 1}', "[NaN]", '["float", NaN]', "[" * 100000, "[1" + "0" * 100000 + "]", '["str", "\\ud800', "\xff",
    '["list", [["none"]], 1]', '[["none"]]',
])
def test_the_decoder_refuses_every_malformed_form(text: str) -> None:
    with pytest.raises(PlainDataError):
        loads(text)


def test_the_decoder_refuses_bytes_that_are_not_utf8_or_too_long() -> None:
    with pytest.raises(PlainDataError):
        loads(b"\xff\xfe")
    with pytest.raises(PlainDataError):
        loads(b" " * (plaindata.MAX_BYTES + 1))
    assert loads(b'["int","5"]') == 5


def test_colliding_hashes_stay_cheap() -> None:
    """Ints whose hashes all collide cost quadratic time in a set; the element bound keeps it small."""
    colliding = {k * (2 ** 61 - 1) for k in range(plaindata.MAX_HASHED)}
    text = dumps(colliding)
    start = time.perf_counter()
    assert loads(text) == colliding
    assert time.perf_counter() - start < 1.0


def test_fuzzed_input_never_raises_anything_else_and_stays_fast() -> None:
    """Random bytes, random JSON, and mutations of valid encodings: PlainDataError or a value, never
    another exception, and each decode fast."""
    rng = random.Random(48)
    seeds = [dumps(v) for v in VALUES]
    worst = 0.0
    for i in range(20000):
        kind = i % 3
        if kind == 0:
            data: str | bytes = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        elif kind == 1:
            data = json.dumps(_random_json(rng, 6))
        else:
            text = rng.choice(seeds)
            cut = rng.randint(0, len(text))
            data = text[:cut] + rng.choice(['"', "[", "]", ",", "0", "x", '["int","', "\\", ""]) + text[cut + 1:]
        start = time.perf_counter()
        try:
            loads(data)
        except PlainDataError:
            pass
        worst = max(worst, time.perf_counter() - start)
    assert worst < 0.5


def _random_json(rng: random.Random, depth: int) -> Any:
    tags = ["none", "bool", "int", "float", "str", "bytes", "list", "tuple", "set", "frozenset", "dict", "x"]
    choice = rng.randint(0, 6 if depth > 0 else 4)
    if choice == 0:
        return rng.choice([None, True, 0, -1, 1.5, "", "9" * rng.randint(1, 50)])
    if choice == 1:
        return rng.choice(tags)
    if choice in (2, 3, 4):
        return [rng.choice(tags), rng.choice([None, True, "1", "ab", "0.5", 3, []])][: rng.randint(1, 3)]
    return [rng.choice(tags), [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 4))]]
