"""Plain data across the grading boundary: an explicit, tagged JSON form of the values a function may
return, and a strict, bounded decoder for it.

Why a format of our own and not pickle or repr: the grader compares what a candidate's function
returned against expected values it alone holds, so only data whose equality the grader's own
builtins define may cross. Values are encoded by EXACT type (`type(x) is int`, never isinstance):
a subclass of str, int or tuple with a lying `__eq__`, a mock, a proxy or any other object has no
encoding, so it cannot arrive as anything but a failed case. The decoder never trusts its input:
every node is checked for tag, arity and payload type, and the whole is bounded in bytes, depth,
node count, container size (sets and dicts at most MAX_HASHED: colliding hashes cost quadratic
time), string length and integer digits; anything else raises `PlainDataError` (a ValueError) and
nothing else (no RecursionError, no MemoryError from a hostile depth, no quadratic int parse).

The forms (one JSON array per value):
    ["none"]  ["bool", true]  ["int", "-12"]  ["float", "0.5" | "inf" | "-inf" | "nan"]
    ["str", "text"]  ["bytes", "68656c6c6f"]  ["list", [v, ...]]  ["tuple", [v, ...]]
    ["set", [v, ...]]  ["frozenset", [v, ...]]  ["dict", [[k, v], ...]]

Standalone on purpose (standard library only, Python 3.8+): the grading sandbox gets a copy of this
file next to `runner.py`, which encodes there what the candidate returned; the grader imports it to
encode the cases and to decode the runner's lines.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_BYTES = 256 * 1024  # one encoded value (one case's result line)
MAX_DEPTH = 32
MAX_NODES = 10_000
MAX_HASHED = 2_000  # elements of one set, frozenset or dict
MAX_CHARS = 64 * 1024  # one str (characters) or bytes (bytes)
MAX_INT_DIGITS = 4_000
SEQUENCES = {"list": list, "tuple": tuple}
SETS = {"set": set, "frozenset": frozenset}
_INT = re.compile(r"0|-?[1-9][0-9]*")
_FLOAT = re.compile(r"-?(?:inf|nan|[0-9]+\.[0-9]+(?:e[+-][0-9]+)?|[0-9]+e[+-][0-9]+)")
_HEX = re.compile(r"(?:[0-9a-f]{2})*")


class PlainDataError(ValueError):
    """A value that is not plain data (encoding) or text that is not a valid encoding (decoding)."""


def encode(value: Any) -> list[Any]:
    """The tagged form of `value`; PlainDataError if it is not plain data or passes a bound."""
    return _Encoder().value(value, 0)


def dumps(value: Any) -> str:
    """`encode` as compact JSON text (ASCII: one line whatever the strings hold)."""
    text = json.dumps(encode(value), separators=(",", ":"))
    if len(text) > MAX_BYTES:
        raise PlainDataError(f"the encoded value has {len(text)} bytes, over {MAX_BYTES}")
    return text


def loads(text: str | bytes) -> Any:
    """The value `dumps` encoded; PlainDataError on anything else. Never raises another exception
    and runs in time linear in the (bounded) input."""
    return decode(parse_json(text))


def parse_json(text: str | bytes, limit: int = MAX_BYTES) -> Any:
    """JSON text to JSON values, bounded: at most `limit` bytes, no NaN/Infinity literals, no
    number longer than 64 characters (the tagged form holds numbers as strings)."""
    if type(text) is bytes:
        if len(text) > limit:
            raise PlainDataError(f"over {limit} bytes")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise PlainDataError("not UTF-8") from None
    if type(text) is not str:
        raise PlainDataError("not text")
    if len(text) > limit:
        raise PlainDataError(f"over {limit} characters")
    try:
        return json.loads(text, parse_int=_short_number(int), parse_float=_short_number(float),
                          parse_constant=_no_constant)
    except PlainDataError:
        raise
    except (ValueError, RecursionError, MemoryError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise PlainDataError(f"not JSON: {type(exc).__name__}") from None


def decode(tree: Any) -> Any:
    """The value of one tagged form (already parsed JSON); PlainDataError if it is not one."""
    return _Decoder().value(tree, 0)


class _Encoder:
    def __init__(self) -> None:
        self.nodes = 0

    def value(self, x: Any, depth: int) -> list[Any]:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise PlainDataError(f"more than {MAX_NODES} values")
        if depth > MAX_DEPTH:
            raise PlainDataError(f"nested deeper than {MAX_DEPTH}")
        t = type(x)
        if x is None:
            return ["none"]
        if t is bool:
            return ["bool", x]
        if t is int:
            return ["int", _int_text(x)]
        if t is float:
            return ["float", repr(x)]
        if t is str:
            if len(x) > MAX_CHARS:
                raise PlainDataError(f"a str of over {MAX_CHARS} characters")
            return ["str", x]
        if t is bytes:
            if len(x) > MAX_CHARS:
                raise PlainDataError(f"bytes of over {MAX_CHARS}")
            return ["bytes", x.hex()]
        if t is list or t is tuple:
            return [t.__name__, [self.value(v, depth + 1) for v in list(x)]]
        if t is set or t is frozenset:
            if len(x) > MAX_HASHED:
                raise PlainDataError(f"a {t.__name__} of over {MAX_HASHED} elements")
            return [t.__name__, [self.value(v, depth + 1) for v in list(x)]]
        if t is dict:
            if len(x) > MAX_HASHED:
                raise PlainDataError(f"a dict of over {MAX_HASHED} items")
            return ["dict", [[self.value(k, depth + 1), self.value(v, depth + 1)] for k, v in list(x.items())]]
        raise PlainDataError(f"a {str(t.__name__)[:60]} is not plain data")


def _int_text(x: int) -> str:
    if x.bit_length() > MAX_INT_DIGITS * 3.33:  # str() of a huge int is slow, and refused past 4300 digits
        raise PlainDataError(f"an int of over {MAX_INT_DIGITS} digits")
    text = str(x)
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise PlainDataError(f"an int of over {MAX_INT_DIGITS} digits")
    return text


class _Decoder:
    def __init__(self) -> None:
        self.nodes = 0

    def value(self, node: Any, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise PlainDataError(f"more than {MAX_NODES} values")
        if depth > MAX_DEPTH:
            raise PlainDataError(f"nested deeper than {MAX_DEPTH}")
        if type(node) is not list or not node or type(node[0]) is not str:
            raise PlainDataError("a value is not a tagged array")
        tag = node[0]
        if tag == "none":
            _arity(node, 1)
            return None
        _arity(node, 2)
        payload = node[1]
        if tag in _SCALARS:
            return _SCALARS[tag](payload)
        if tag in SEQUENCES or tag in SETS:
            items = [self.value(v, depth + 1) for v in _array(payload)]
            return SEQUENCES[tag](items) if tag in SEQUENCES else self.hashed(SETS[tag], items)
        if tag == "dict":
            pairs = _array(payload)
            if len(pairs) > MAX_HASHED:
                raise PlainDataError(f"a dict of over {MAX_HASHED} items")
            items = [self.pair(p, depth + 1) for p in pairs]
            return self.hashed(dict, items)
        raise PlainDataError(f"unknown tag {tag[:20]!r}")

    def pair(self, node: Any, depth: int) -> tuple[Any, Any]:
        if type(node) is not list or len(node) != 2:
            raise PlainDataError("a dict item is not a [key, value] array")
        return self.value(node[0], depth), self.value(node[1], depth)

    @staticmethod
    def hashed(kind: Any, items: list[Any]) -> Any:
        if len(items) > MAX_HASHED:
            raise PlainDataError(f"a {kind.__name__} of over {MAX_HASHED} elements")
        try:
            return kind(items)
        except TypeError:  # an unhashable key or element (a list): no such value exists
            raise PlainDataError(f"an unhashable element in a {kind.__name__}") from None


def _arity(node: list[Any], n: int) -> None:
    if len(node) != n:
        raise PlainDataError(f"{node[0][:20]!r} takes {n - 1} field(s)")


def _array(payload: Any) -> list[Any]:
    if type(payload) is not list:
        raise PlainDataError("a container's items are not an array")
    if len(payload) > MAX_NODES:
        raise PlainDataError(f"more than {MAX_NODES} values")
    return payload


def _bool(payload: Any) -> bool:
    if type(payload) is not bool:
        raise PlainDataError("a bool that is not true or false")
    return payload


def _int(payload: Any) -> int:
    if type(payload) is not str or len(payload) - payload.startswith("-") > MAX_INT_DIGITS \
            or not _INT.fullmatch(payload):
        raise PlainDataError("an int that is not a bounded decimal string")
    return int(payload)


def _float(payload: Any) -> float:
    if type(payload) is not str or len(payload) > 40 or not _FLOAT.fullmatch(payload):
        raise PlainDataError("a float that is not a float's repr")
    return float(payload)


def _str(payload: Any) -> str:
    if type(payload) is not str or len(payload) > MAX_CHARS:
        raise PlainDataError("a str that is not a bounded string")
    return payload


def _bytes(payload: Any) -> bytes:
    if type(payload) is not str or len(payload) > 2 * MAX_CHARS or not _HEX.fullmatch(payload):
        raise PlainDataError("bytes that are not bounded lowercase hex")
    return bytes.fromhex(payload)


_SCALARS = {"bool": _bool, "int": _int, "float": _float, "str": _str, "bytes": _bytes}


def _short_number(kind: Any) -> Any:
    def parse(text: str) -> Any:
        if len(text) > 64:
            raise PlainDataError("a JSON number of over 64 characters")
        return kind(text)
    return parse


def _no_constant(name: str) -> Any:
    raise PlainDataError(f"the JSON constant {name} is not allowed")

