"""OpenAI tool calling against a replica: the real process on loopback, and in-process with scripted tokens.

The tiny model never writes a `<tool_call>` block by itself, so the tests of the parse path put the
block's tokens in its mouth: the in-process replica's engine samples as usual and then takes the
scripted token instead (`scripted`), so everything else (routes, render, finish, capture, sessions,
streaming, continuity) is the real code, and the OpenAI SDK reads both answers.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.http_client import HTTP

from .conftest import Server

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers and return the sum.",
                                        "parameters": {"type": "object", "required": ["a", "b"],
                                                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
QUESTION = {"role": "user", "content": "What is 10 + 20? Use the tool."}
CALL = "I will add.\n<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 10, "b": 20}}) + "\n</tool_call>"


def sdk(url: str, http_client=None) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http_client)


def post(server: Server, body: dict):
    return HTTP.post(server.url + "/v1/chat/completions", json={"model": "base", "max_tokens": 4, **body}, timeout=120)


def history(call_id: str = "call_1") -> list[dict]:
    """A conversation in which the assistant called the tool and the tool answered."""
    call = {"id": call_id, "type": "function", "function": {"name": "add", "arguments": '{"a": 10, "b": 20}'}}
    return [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "name": "add", "content": "30"}]


# ---- a real replica process ----

@pytest.mark.slow  # a replica process; the fast lane keeps the in-process tests below
def test_tools_are_rendered_into_the_captured_prompt(server: Server, tokenizer) -> None:
    r = post(server, {"messages": [QUESTION], "tools": [ADD], "tool_choice": "auto", "parallel_tool_calls": True,
                      "session_id": "tools-1", "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt_token_ids"]
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools\n") and "\n" + json.dumps(ADD) + "\n</tools>" in text
    assert server.get("/v1/traces/tools-1?full=true")["calls"][0]["prompt_ids"] == prompt
    plain = post(server, {"messages": [QUESTION], "tools": [ADD], "tool_choice": "none", "return_token_ids": True})
    assert plain.status_code == 200, plain.text
    assert "# Tools" not in tokenizer.decode(plain.json()["prompt_token_ids"], skip_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("extra, needle", [
    ({"tool_choice": "required"}, "'required' is not supported"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "naming a function is not supported"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"messages": [QUESTION, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                    "function": {"name": "add", "arguments": "{"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(server: Server, extra: dict, needle: str) -> None:
    r = post(server, {"messages": [QUESTION], "tools": [ADD], **extra})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    legacy = HTTP.post(server.url + "/v1/completions", json={"model": "base", "prompt": "x", "tools": [ADD]}, timeout=60)
    assert legacy.status_code == 400 and "tools" in legacy.json()["error"]["message"]


@pytest.mark.slow  # a replica process; the fast lane keeps the in-process tests below
def test_openai_sdk_round_trip_with_tool_calls_in_history(server: Server, tokenizer) -> None:
    client = sdk(server.url)
    kw = {"model": "base", "messages": history(), "tools": [ADD], "max_tokens": 4, "temperature": 0,
          "extra_body": {"return_token_ids": True}}
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.role == "assistant" and message.tool_calls is None
    text = tokenizer.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 20}}\n</tool_call>'
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n30\n</tool_response><|im_end|>\n") in text

    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    final = state.current_completion_snapshot.choices[0]  # get_final_completion() refuses a "length" finish
    assert final.message.content == message.content and final.message.tool_calls is None
    assert final.finish_reason == r.choices[0].finish_reason


# ---- in process, with the tool call's tokens scripted ----

@pytest.fixture(scope="module")
def app_client(replica) -> TestClient:
    from burstrl.inference.server import build_app

    return TestClient(build_app(replica))


@pytest.fixture
def script(replica, tokenizer, monkeypatch):
    """`script(session_id, text)`: that session's next call samples `text`'s tokens, then <|im_end|>."""
    scripts: dict[str, list[int]] = {}
    real = replica.engine._sample
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def sample(logits, reqs):
        out = real(logits, reqs)
        for i, req in enumerate(reqs):
            ids = scripts.get(req.session.id)
            if ids is not None and isinstance(out[i], tuple):
                out[i] = (ids[len(req.completion_ids)], *out[i][1:])
        return out

    def put(session_id: str, text: str) -> None:
        scripts[session_id] = tokenizer.encode(text, add_special_tokens=False) + [end]

    monkeypatch.setattr(replica.engine, "_sample", sample)
    return put


def test_a_sampled_tool_call_comes_back_as_tool_calls_and_the_next_turn_continues(
        replica, app_client: TestClient, script) -> None:
    client = sdk("http://testserver", app_client)
    script("tc-1", CALL)
    kw = {"model": "base", "tools": [ADD], "max_tokens": 200, "extra_body": {"session_id": "tc-1"}}
    r = client.chat.completions.create(messages=[QUESTION], **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will add."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 10, "b": 20}

    before = replica.chat.continued
    script("tc-1", "30.")
    turn2 = [QUESTION, choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "name": "add", "content": "30"}]
    r2 = client.chat.completions.create(messages=turn2, **kw)
    assert r2.choices[0].message.content == "30." and r2.choices[0].message.tool_calls is None
    assert replica.chat.continued == before + 1
    first, second = app_client.get("/v1/traces/tc-1?full=true", headers={"Authorization": "Bearer t"}).json()["calls"]
    assert second["prompt_ids"][:len(first["prompt_ids"]) + len(first["completion_ids"])] == (
        first["prompt_ids"] + first["completion_ids"])


def test_a_streamed_tool_call_reaches_the_sdk_as_tool_calls(app_client: TestClient, script) -> None:
    client = sdk("http://testserver", app_client)
    script("tc-stream", CALL + "\n" + CALL.split("\n", 1)[1].replace("20", "5"))
    stream = client.chat.completions.create(model="base", messages=[QUESTION], tools=[ADD], max_tokens=200,
                                            stream=True, logprobs=True, stream_options={"include_usage": True},
                                            extra_body={"session_id": "tc-stream", "return_token_ids": True})
    state, ids, logprobs = ChatCompletionStreamState(), [], 0
    for chunk in stream:
        state.handle_chunk(chunk)
        for ch in chunk.choices:
            ids += ch.model_extra.get("token_ids") or []
            logprobs += len(ch.logprobs.content) if ch.logprobs else 0
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will add."
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"a": 10, "b": 20}, {"a": 10, "b": 5}]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert len(ids) == logprobs == state.get_final_completion().usage.completion_tokens


def test_parallel_tool_calls_false_keeps_the_first_call(app_client: TestClient, script) -> None:
    script("tc-one", CALL + "\n" + CALL.split("\n", 1)[1])
    body = {"model": "base", "messages": [QUESTION], "tools": [ADD], "max_tokens": 200, "parallel_tool_calls": False,
            "session_id": "tc-one"}
    message = app_client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert len(message["tool_calls"]) == 1
    assert message["content"] == "I will add.\n\n" + CALL.split("\n", 1)[1]
