"""The replica's request limits (inference/limits.py, jsonscan.py) and its request workers (workers.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from burstrl.config import RequestLimitsConfig, ServeConfig
from burstrl.inference import jsonscan
from burstrl.inference.jsonscan import scan_json
from burstrl.inference.limits import (
    LimitError,
    RequestLimits,
    check_chat,
    check_completion,
    check_json_size,
)
from burstrl.inference.workers import RequestWorkers

LIMITS = RequestLimits.derive(RequestLimitsConfig(), 4096)


def items_of(value: Any) -> int:
    """What `scan_json` must count in `json.dumps(value)`: `[` and `{` per container, `,` between its
    entries, `:` per key."""
    if isinstance(value, list):
        return 1 + max(0, len(value) - 1) + sum(items_of(v) for v in value)
    if isinstance(value, dict):
        return 1 + max(0, len(value) - 1) + len(value) + sum(items_of(v) for v in value.values())
    return 0


def depth_of(value: Any) -> int:
    """Containers nested in `value`, itself included."""
    if isinstance(value, (list, dict)):
        inner = value.values() if isinstance(value, dict) else value
        return 1 + max((depth_of(v) for v in inner), default=0)
    return 0


tricky_text = st.text(alphabet=st.sampled_from(list('ab,:[{"\\\n}]') + ["\u00e9"]), max_size=12)
documents = st.recursive(st.one_of(st.none(), st.integers(), tricky_text),
                         lambda kids: st.one_of(st.lists(kids, max_size=5), st.dictionaries(tricky_text, kids, max_size=5)),
                         max_leaves=20)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(documents, st.integers(2, 7), st.booleans(), st.integers(0, 4))
def test_items_and_depth_are_found_outside_strings_whatever_the_window(doc: Any, window: int, ascii_only: bool,
                                                                       max_depth: int) -> None:
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode()
    items, depth = items_of(doc), depth_of(doc)
    original = jsonscan.WINDOW
    jsonscan.WINDOW = window  # tiny windows cut strings and escapes at every possible byte
    try:
        assert scan_json(raw, items, 10**6) == (items, False)
        assert scan_json(raw, 10**9, 0)[0] >= items  # the first step counts the bytes inside strings too
        if items:  # one item too many for the first step: the windows decide
            counted, too_deep = scan_json(raw, items - 1, max_depth)
            assert too_deep == (depth > max_depth)
            assert too_deep or counted == items
    finally:
        jsonscan.WINDOW = original


def test_scanning_stops_within_a_window_of_a_limit() -> None:
    counted, too_deep = scan_json(b"[" + b"1," * 1_000_000 + b"1]", 100, 64)
    assert 100 < counted <= 100 + jsonscan.WINDOW and not too_deep
    assert scan_json(b"[" * 100 + b"]" * 100, 80, 64) == (65, True)
    assert scan_json(b'"' + b"," * 1000, 10, 64) == (0, False)  # unterminated string: json.loads says so
    assert scan_json(b'{"a":"' + b"," * 10 + b"\\", 5, 64) == (2, False)  # a lone backslash at the end
    with pytest.raises(LimitError, match="nested deeper than 64 levels"):
        check_json_size(b"[" * 100_000 + b"]" * 100_000, LIMITS)
    with pytest.raises(LimitError, match="limits.max_json_items"):
        check_json_size(b"[" + b"[1]," * 20_000 + b"1]", LIMITS)
    check_json_size(b"[" + b"[1]," * 9_000 + b"1]", LIMITS)


def test_defaults_derive_from_the_context_and_config_overrides_them() -> None:
    assert (LIMITS.max_prompt_chars, LIMITS.max_messages, LIMITS.max_json_items) == (65536, 4096, 36864)
    cfg = ServeConfig.model_validate({"limits": {"max_prompt_chars": 10, "max_messages": 2, "max_json_items": 50,
                                                 "max_json_depth": 8}})
    set_ = RequestLimits.derive(cfg.limits, 4096)
    assert (set_.max_prompt_chars, set_.max_messages, set_.max_json_items, set_.max_json_depth) == (10, 2, 50, 8)
    with pytest.raises(ValueError, match="max_mesages"):
        ServeConfig.model_validate({"limits": {"max_mesages": 2}})


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "7" * 65537}, "limits.max_prompt_chars"),
    ({"prompt": ["7" * 65537]}, "limits.max_prompt_chars"),
    ({"prompt": [1] * 4096}, "maximum context length is 4096"),
    ({"prompt": [[1] * 4096]}, "maximum context length is 4096"),
    ({"input_ids": [1] * 4096}, "maximum context length is 4096"),
    ({"stop": ["y" * 40000, "y" * 30000]}, "limits.max_prompt_chars"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids has 1025 entries"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias has 1025 entries"),
    ({"model": "m" * 257}, "model name"),
])
def test_completion_sizes_past_the_limits_name_them(body: dict, needle: str) -> None:
    with pytest.raises(LimitError, match=needle):
        check_completion({"model": "base", **body}, LIMITS)


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "user", "content": ""}] * 4097, "limits.max_messages"),
    ([{"role": "user", "content": [{"type": "text", "text": ""}] * 4097}], "limits.max_messages"),
    ([{"role": "user", "content": "x" * 40000}, {"role": "user", "content": "x" * 30000}], "limits.max_prompt_chars"),
    ([{"role": "user", "content": [{"type": "text", "text": "x" * 65537}]}], "limits.max_prompt_chars"),
])
def test_chat_sizes_past_the_limits_name_them(messages: list, needle: str) -> None:
    with pytest.raises(LimitError, match=needle):
        check_chat({"model": "base", "messages": messages}, LIMITS)


@pytest.mark.parametrize("body", [
    {"prompt": [1] * 4095}, {"prompt": "7" * 65536}, {"prompt": ["a", "b"]}, {"prompt": None}, {"prompt": 5},
    {"messages": "not a list"}, {"messages": [5, None, {"content": {"x": 1}}]}, {"stop": "y"},
])
def test_sizes_within_the_limits_or_of_the_wrong_type_are_left_to_validation(body: dict) -> None:
    check_completion({"model": "base", **body}, LIMITS)
    check_chat({"model": "base", **body}, LIMITS)


def test_workers_run_off_the_calling_thread_raise_there_and_stop() -> None:
    workers = RequestWorkers(2)

    async def main() -> None:
        assert await workers.run(threading.get_ident) != threading.get_ident()
        with pytest.raises(LimitError):
            await workers.run(check_chat, {"messages": [{}] * 5000}, LIMITS)

    asyncio.run(main())
    workers.close()
    with pytest.raises(RuntimeError):
        asyncio.run(workers.run(int))
