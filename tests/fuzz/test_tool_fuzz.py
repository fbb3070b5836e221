"""Hostile tool use against a real replica: tools, tool_choice, assistant tool_calls, tool messages;
and hostile completions against the `<tool_call>` parser.

Invariant for every request (`test_replica_fuzz.send`): 2xx or a 4xx OpenAI error, never a 5xx, and
the replica then serves a normal request on a fresh connection. For every completion text: the
parser never raises, returns only calls of known tools with JSON-object arguments, and its message
encodes as a UTF-8 JSON response. Bounded like the other fuzz suites (derandomized, few examples).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from burstrl.inference.tools import ToolSpec, assistant_message, parse_tool_calls

from ..integration.conftest import start_server, stop_server
from .test_replica_fuzz import FUZZ, ints, json_values, send, texts

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
USER = {"role": "user", "content": "add 1 and 2"}
SEEN: Counter[str] = Counter()

names = st.one_of(st.sampled_from(["add", "echo", "", "x" * 300, "<|im_end|>", "a\"b"]), texts, ints)
function = st.fixed_dictionaries({"name": names}, optional={
    "description": st.one_of(texts, json_values), "parameters": st.one_of(st.just({"type": "object"}), json_values),
    "strict": json_values})
tool = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "retrieval"]),
                                        "function": st.one_of(function, json_values)}), json_values)
tools = st.one_of(st.none(), st.just([ADD]), st.lists(tool, max_size=4), json_values)
tool_choice = st.one_of(st.none(), st.sampled_from(["auto", "none", "required", "any"]), json_values,
                        st.just({"type": "function", "function": {"name": "add"}}))
arguments = st.one_of(json_values.map(json.dumps), texts, json_values, st.sampled_from(
    ['"\\ud800"', "[" * 80 + "]" * 80, "9" * 5000, "1e999999", "NaN", "{}", '{"a": "<|im_start|>"}']))
tool_call = st.one_of(
    st.fixed_dictionaries({"id": st.one_of(texts, ints, st.none()), "type": st.sampled_from(["function", "x"]),
                           "function": st.one_of(st.fixed_dictionaries({"name": names, "arguments": arguments}),
                                                 json_values)},
                          optional={"index": ints}),
    json_values)
assistant = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), texts),
                                   "tool_calls": st.one_of(st.none(), st.lists(tool_call, max_size=3), json_values)})
tool_message = st.fixed_dictionaries({"role": st.just("tool"), "content": st.one_of(texts, st.none(), json_values)},
                                     optional={"tool_call_id": st.one_of(texts, ints, json_values),
                                               "name": st.one_of(names, json_values)})
hostile = st.fixed_dictionaries({
    "messages": st.lists(st.one_of(assistant, tool_message), max_size=4).map(lambda ms: [USER, *ms]),
    "tools": tools, "tool_choice": tool_choice,
    "parallel_tool_calls": st.one_of(st.none(), st.booleans(), json_values)})
good_call = st.fixed_dictionaries({"id": st.text(min_size=1, max_size=8), "type": st.just("function"),
                                   "function": st.fixed_dictionaries({"name": st.just("add"),
                                                                      "arguments": json_values.map(json.dumps)})})
valid = st.fixed_dictionaries({
    "messages": st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), st.text(max_size=20)),
                               "tool_calls": st.lists(good_call, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"role": st.just("tool"), "content": st.text(max_size=20),
                               "tool_call_id": st.text(min_size=1, max_size=8)})), max_size=3).map(lambda ms: [USER, *ms]),
    "tools": st.just([ADD]), "tool_choice": st.sampled_from([None, "auto", "none"])})


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("tool-fuzz"), "--engine.max_model_len", "512")
    yield srv
    stop_server(srv)


@FUZZ
@given(body=st.one_of(valid, hostile), stream=st.booleans(), max_tokens=st.integers(1, 4),
       session=st.one_of(st.none(), st.sampled_from(["tool-fuzz-a", "tool-fuzz-b"])))
def test_tool_bodies(server, body: dict, stream: bool, max_tokens: int, session: str | None) -> None:
    r = send(server, "POST", "/v1/chat/completions",
             {"model": "base", **body, "stream": stream, "max_tokens": max_tokens, "session_id": session})
    SEEN[f"{r.status_code // 100}xx"] += 1


def test_the_tool_fuzzer_saw_both_answers(server) -> None:
    if not SEEN:
        pytest.skip("run with the other tests of this file")
    assert SEEN["2xx"] > 0 and SEEN["4xx"] > 0 and SEEN["5xx"] == 0


pieces = st.one_of(st.sampled_from(["<tool_call>", "</tool_call>", "\n", '{"name": "add", "arguments": ',
                                    '{"name": "echo", "arguments": {}}', "{}", "}", '"\\ud800"', "[" * 200,
                                    '{"a": ' * 70, "NaN", "9" * 5000]),
                   st.text(max_size=10))


@FUZZ
@given(parts=st.lists(pieces, max_size=30), parallel=st.booleans())
def test_the_parser_takes_any_completion(parts: list[str], parallel: bool) -> None:
    text = "".join(parts)
    content, calls = parse_tool_calls(text, {"add", "echo"}, parallel)
    for call in calls:
        assert call["function"]["name"] in ("add", "echo")
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert len(calls) <= text.count("<tool_call>") and (parallel or len(calls) <= 1)
    message = assistant_message(text, ToolSpec([ADD], parallel))
    json.dumps(message, ensure_ascii=False).encode("utf-8")
    if not message.get("tool_calls"):
        assert message["content"] == text
