"""Every hostile request of issue 14, as a named regression test against a real replica process.

Invariant after each case (`assert_serving`): the replica answers /health 200 and serves a normal
request on a fresh connection. Each case names the answer it must get instead of what it got
before (an engine killed for every client, a wedged session, a 500, a silent default).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.http_client import HTTP

from ..integration.conftest import ADMIN_TOKEN, Server, start_server, stop_server

CLUSTER_TOKEN = "fuzz-cluster-token"
CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "base", "prompt": [5, 6, 7], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from burstrl.model.lora import make_random_adapter

    root = tmp_path_factory.mktemp("hostile")
    srv = start_server(tiny_model_dir, root, "--server.cluster_token", CLUSTER_TOKEN)
    adapter = make_random_adapter(tiny_model_dir, root / "policy-v1", seed=1)
    r = HTTP.post(srv.url + "/v1/load_lora_adapter", headers=srv.admin(),
                  json={"lora_name": "policy-v1", "lora_path": str(adapter)}, timeout=60)
    assert r.status_code == 200, r.text
    yield srv
    stop_server(srv)


def assert_serving(server: Server) -> None:
    with httpx.Client(timeout=60) as fresh:
        assert fresh.get(server.url + "/health").status_code == 200
        r = fresh.post(server.url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text


def post(server: Server, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(server.url + path, content=content, timeout=120,
                     headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)


def assert_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status


def test_tiny_temperature_is_greedy_not_an_engine_crash(server: Server) -> None:
    body = {**COMPLETION, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    tiny = post(server, "/v1/completions", {**body, "temperature": 1e-50})
    greedy = post(server, "/v1/completions", {**body, "temperature": 0})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    assert_serving(server)


@pytest.mark.parametrize("top_k", [9223372036854775808, 10**30, 2**31, 10**6])
def test_huge_top_k_is_off_not_an_overflow(server: Server, top_k: int) -> None:
    r = post(server, "/v1/completions", {**COMPLETION, "top_k": top_k, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert_serving(server)


def test_out_of_range_seed_is_a_400_and_the_session_is_not_wedged(server: Server) -> None:
    body = {**COMPLETION, "session_id": "seed-wedge"}
    assert_error(post(server, "/v1/completions", {**body, "seed": 2**64}), 400, "seed")
    assert_error(post(server, "/v1/completions", {**body, "seed": -(2**63) - 1}), 400, "seed")
    assert post(server, "/v1/completions", {**body, "seed": 2**64 - 1}).status_code == 200
    r = HTTP.delete(server.url + "/v1/traces/seed-wedge", headers=server.admin())
    assert r.status_code == 200, r.text
    assert_serving(server)


def test_zero_completion_tokens_is_a_400_and_null_max_tokens_is_the_default(server: Server) -> None:
    assert_error(post(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}), 400, "max_tokens")
    assert_error(post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 0}), 400, "max_tokens")
    r = post(server, "/v1/completions", {**COMPLETION, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("body,needle", [
    ({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "surrogate"),
    ({**COMPLETION, "prompt": "a\udfffb"}, "surrogate"),
    ({**CHAT, "stop": ["\ud800"]}, "surrogate"),
])
def test_lone_surrogates_are_a_400(server: Server, body: dict, needle: str) -> None:
    assert_error(post(server, "/v1/chat/completions" if "messages" in body else "/v1/completions",
                      json.dumps(body).encode()), 400, needle)
    assert_serving(server)


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_a_400(server: Server, depth: int) -> None:
    body = b'{"model": "base", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    assert_error(post(server, "/v1/chat/completions", body), 400, "nested")
    assert_serving(server)


def test_unknown_routes_and_bad_parameters_are_openai_errors(server: Server) -> None:
    r = HTTP.get(server.url + "/v1/nope")
    assert_error(r, 404, "Not Found")
    r = HTTP.put(server.url + "/v1/adapters/x/shards/zero", params={"of": "many"}, content=b"x",
                 headers=server.admin())
    assert r.status_code == 400 and "error" in r.json()
    r = HTTP.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert_serving(server)


def test_traces_and_session_lists_need_a_token(server: Server) -> None:
    assert post(server, "/v1/completions", {**COMPLETION, "session_id": "private"}).status_code == 200
    assert_error(HTTP.get(server.url + "/v1/traces/private"), 401, "token")
    bad = {"Authorization": "Bearer wrong"}
    assert HTTP.get(server.url + "/v1/traces/private", headers=bad).status_code == 401
    for token in (ADMIN_TOKEN, CLUSTER_TOKEN):
        auth = {"Authorization": f"Bearer {token}"}
        assert HTTP.get(server.url + "/v1/traces/private", headers=auth).json()["calls"]
        assert any(s["session_id"] == "private" for s in HTTP.get(server.url + "/v1/loads", headers=auth).json()["sessions"])
    public = HTTP.get(server.url + "/v1/loads").json()
    assert "sessions" not in public and public["num_sessions"] >= 1


def test_explicit_nulls_are_defaults(server: Server) -> None:
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "n", "stream", "logprobs", "top_logprobs",
                               "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
                               "return_token_ids", "stream_options", "session_id", "min_tokens")}
    r = post(server, "/v1/chat/completions", {**CHAT, **nulls})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {**COMPLETION, **nulls, "echo": None, "suffix": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra,needle", [
    ({"n": 0}, "n must be an integer from 1 to 64"),
    ({"n": 2, "stream": True}, "n > 1 is answered whole"),
    ({"echo": True}, "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"best_of": 3}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"prompt": ["a", "b"]}, "batch prompts"),
    ({"prompt": [[1, 2], [3, 4]]}, "batch prompts"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 99}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_unsupported_or_bad_options_are_a_400_never_ignored(server: Server, extra: dict, needle: str) -> None:
    assert_error(post(server, "/v1/completions", {**COMPLETION, **extra}), 400, needle)


def test_single_prompt_in_a_list_and_supported_options_work(server: Server) -> None:
    r = post(server, "/v1/completions", {**COMPLETION, "prompt": ["Once upon a time"], "min_tokens": 2,
                                         "presence_penalty": 0.5, "frequency_penalty": 0.5,
                                         "repetition_penalty": 1.2, "min_p": 0.05, "logit_bias": {"5": -100}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 2


def test_stop_reason_names_the_stop_string_or_token(server: Server) -> None:
    base = {**COMPLETION, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ids = post(server, "/v1/completions", base).json()["choices"][0]["token_ids"]
    r = post(server, "/v1/completions", {**base, "stop_token_ids": [ids[3]]}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == ids[3] and r["token_ids"][-1] == ids[3]
    text = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    needle = text.strip()[2:4]
    if needle:
        r = post(server, "/v1/completions", {**base, "stop": [needle]}).json()["choices"][0]
        assert r["finish_reason"] == "stop" and r["stop_reason"] == needle
    plain = post(server, "/v1/completions", {**base, "max_tokens": 3}).json()["choices"][0]
    assert plain["finish_reason"] == "length" and plain["stop_reason"] is None


def stream_chunks(server: Server, path: str, body: dict) -> list[dict]:
    chunks = []
    with HTTP.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_streaming_prompt_token_ids_where_vllm_puts_them(server: Server) -> None:
    chat = stream_chunks(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True})
    assert chat[0]["prompt_token_ids"] and "prompt_token_ids" not in chat[0]["choices"][0]
    assert all("prompt_token_ids" not in c for c in chat[1:])
    text = stream_chunks(server, "/v1/completions", {**COMPLETION, "return_token_ids": True})
    assert text[0]["choices"][0]["prompt_token_ids"] == COMPLETION["prompt"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in text[1:])
    assert "stop_reason" in text[-1]["choices"][0]


def test_models_name_their_parent_and_root(server: Server) -> None:
    cards = {m["id"]: m for m in HTTP.get(server.url + "/v1/models").json()["data"]}
    assert cards["base"]["parent"] is None
    assert cards["policy-v1"]["parent"] == "base" and cards["policy-v1"]["root"].endswith("policy-v1")


def test_masked_alternatives_are_finite_in_json(server: Server) -> None:
    """Found by the fuzzer: top_k=1 with 2 top logprobs put -inf in the body (a 500, invalid JSON)."""
    r = post(server, "/v1/completions", {**COMPLETION, "top_k": 1, "logprobs": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"][0]  # two entries, the second -9999.0
    chat = {**CHAT, "top_k": 1, "logprobs": True, "top_logprobs": 3}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in tops][1:] == [-9999.0, -9999.0]
    chunks = stream_chunks(server, "/v1/chat/completions", chat)
    assert any(c["choices"] and c["choices"][0].get("logprobs") for c in chunks)
