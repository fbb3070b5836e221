"""Property-based hostile bodies against a real replica: chat, completions, adapter admin, uploads.

Invariant for every example: the answer is 2xx or 4xx with a JSON body (an OpenAI `error` object on
4xx), never a 5xx, and afterwards the replica is healthy and serves a normal request on a fresh
connection. Bounded: a fixed number of derandomized examples per endpoint, and generation lengths
kept small so the file runs in well under a minute. Counts are written to
`$BURSTRL_FUZZ_REPORT` (JSON) when set, for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http_client import HTTP

from ..integration.conftest import Server, start_server, stop_server

EXAMPLES = int(os.environ.get("BURSTRL_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
SEEN: Counter[str] = Counter()

ints = st.one_of(st.integers(-3, 6), st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-50, 0.0, 1.0, -0.0]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=12))
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=12)
texts = st.one_of(st.text(max_size=40), st.sampled_from(["\ud800", "a\udfffb", "\x00", "<|im_end|>", ""]))
models = st.one_of(st.sampled_from(["base", "policy-v1"]),
                   st.sampled_from(["base", "policy-v1", "policy-v99", "", "latest", "../../etc"]))
SAMPLING = {
    "temperature": st.one_of(st.none(), floats), "top_p": st.one_of(st.none(), floats),
    "top_k": st.one_of(st.none(), ints), "min_p": st.one_of(st.none(), floats),
    "seed": st.one_of(st.none(), ints), "n": st.one_of(st.none(), ints),
    "stop": st.one_of(st.none(), texts, st.lists(texts, max_size=10)),
    "stop_token_ids": st.one_of(st.none(), st.lists(ints, max_size=3)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.one_of(st.text(max_size=4), ints.map(str)), floats, max_size=3)),
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "min_tokens": ints, "ignore_eos": st.one_of(st.none(), st.booleans()),
    "return_token_ids": st.one_of(st.none(), st.booleans()), "session_id": st.one_of(st.none(), texts),
    "stream": st.one_of(st.none(), st.booleans()), "tools": json_values, "response_format": json_values,
    "echo": json_values, "extra_unknown_field": json_values,
}
hostile_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                                   "content": st.one_of(texts, st.none(), json_values)}), max_size=4)
plain_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": st.text(max_size=40)}), min_size=1, max_size=3)
messages = st.one_of(plain_messages, plain_messages, hostile_messages)
token_ids = st.lists(st.one_of(st.integers(0, 300), ints), max_size=40)


def body_with(required: dict) -> st.SearchStrategy[dict]:
    """A body that is valid but for 0-3 fuzzed fields: many examples reach the engine, many do not."""
    fuzzed = st.one_of(st.just({}), st.lists(st.sampled_from(sorted(SAMPLING)), min_size=1, max_size=3,
                                             unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: SAMPLING[k] for k in keys})))
    valid = st.fixed_dictionaries({**required, "max_tokens": st.integers(1, 6)},
                                  optional={"temperature": st.floats(0, 2), "top_k": st.integers(-1, 50),
                                            "seed": st.integers(0, 2**32), "logprobs": st.booleans()})
    return st.tuples(valid, fuzzed).map(lambda pair: {**pair[0], **pair[1]})


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from burstrl.model.lora import make_random_adapter

    root = tmp_path_factory.mktemp("fuzz")
    srv = start_server(tiny_model_dir, root, "--engine.max_model_len", "256")
    adapter = make_random_adapter(tiny_model_dir, root / "policy-v1", seed=1)
    r = HTTP.post(srv.url + "/v1/load_lora_adapter", headers=srv.admin(),
                  json={"lora_name": "policy-v1", "lora_path": str(adapter)}, timeout=60)
    assert r.status_code == 200, r.text
    yield srv
    engine = {name: srv.metric(f"burstrl:{name}_total") for name in ("failed_requests", "engine_step_failures")}
    engine["alive"] = HTTP.get(srv.url + "/health", timeout=30).status_code == 200
    stop_server(srv)
    report = os.environ.get("BURSTRL_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"replica": dict(SEEN), "engine": engine}))


def send(server: Server, method: str, path: str, body: object = None, raw: bytes | None = None,
         headers: dict | None = None, params: dict | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    with httpx.Client(timeout=120) as client:
        r = client.request(method, server.url + path, content=content, params=params,
                           headers={"content-type": "application/json", **(headers or {})})
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            r.read()
    check(server, r, path)
    return r


def check(server: Server, r: httpx.Response, path: str) -> None:
    SEEN["cases"] += 1
    SEEN[f"{r.status_code // 100}xx"] += 1
    SEEN[f"{path.split('/')[2]} {r.status_code // 100}xx"] += 1
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        assert "message" in r.json()["error"], r.text[:500]
    elif not r.headers.get("content-type", "").startswith("text/event-stream"):
        r.json()
    with httpx.Client(timeout=60) as fresh:
        assert fresh.get(server.url + "/health").status_code == 200
        ok = fresh.post(server.url + "/v1/completions", json={"model": "base", "prompt": [5, 6], "max_tokens": 2})
        assert ok.status_code == 200, ok.text


@FUZZ
@given(body=body_with({"model": models, "messages": messages}))
def test_chat_bodies(server: Server, body: dict) -> None:
    send(server, "POST", "/v1/chat/completions", body)


@FUZZ
@given(body=body_with({"model": models, "prompt": st.one_of(
           st.text(min_size=1, max_size=40), st.lists(st.integers(0, 300), min_size=1, max_size=40),
           st.one_of(texts, token_ids, st.lists(texts, max_size=3), json_values))}),
       logprobs=st.one_of(st.none(), st.integers(0, 5), st.one_of(ints, floats, texts)))
def test_completion_bodies(server: Server, body: dict, logprobs: object) -> None:
    send(server, "POST", "/v1/completions", {**body, "logprobs": logprobs})


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), texts.map(lambda t: t.encode("utf-8", "surrogatepass")),
                     st.sampled_from([b"[" * 5000, b'{"model": "base", "messages": ' + b"{" * 3000, b"null",
                                      b'"\\ud800"', b"1e999999", b"NaN"])),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter",
                             "/v1/unload_lora_adapter", "/v1/adapters/policy-v7/manifest"]))
def test_raw_bytes(server: Server, raw: bytes, path: str) -> None:
    method = "PUT" if path.endswith("manifest") else "POST"
    send(server, method, path, raw=raw, headers=server.admin())


@FUZZ
@given(name=st.one_of(texts, models), path=st.one_of(texts, st.sampled_from(["/", "/etc", "/proc/self", "/dev/zero"])),
       token=st.booleans())
def test_adapter_admin(server: Server, name: str, path: str, token: bool) -> None:
    headers = server.admin() if token else {}
    send(server, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, headers=headers)
    send(server, "POST", "/v1/unload_lora_adapter", {"lora_name": name if name != "policy-v1" else "x"},
         headers=headers)


@FUZZ
@given(name=st.sampled_from(["policy-v7", "a", "..", "x" * 80, "policy v7"]), index=ints, of=ints,
       data=st.binary(max_size=64), manifest=json_values, commit=st.booleans())
def test_uploads(server: Server, name: str, index: int, of: int, data: bytes, manifest: object, commit: bool) -> None:
    from urllib.parse import quote

    base = f"/v1/adapters/{quote(name, safe='')}"
    send(server, "PUT", f"{base}/shards/{index}", raw=data, headers=server.admin(), params={"of": of})
    send(server, "PUT", f"{base}/manifest", manifest, headers=server.admin())
    if commit:
        send(server, "POST", f"{base}/commit", raw=b"", headers=server.admin())


def test_the_fuzzer_saw_every_kind_of_answer(server: Server) -> None:
    """Guards the suite itself: bodies that are served and bodies that are refused both occur."""
    if SEEN["cases"] == 0:
        pytest.skip("run with the other tests of this file")
    assert SEEN["2xx"] > 0 and SEEN["4xx"] > 0 and SEEN["5xx"] == 0
