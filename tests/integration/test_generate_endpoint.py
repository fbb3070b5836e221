"""verifiers' token-in endpoint, `POST /inference/v1/generate`, on a real replica and through a real router.

What verifiers 0.4.0's train client (`renderers.client.generate`) sends and reads: `{model, token_ids,
sampling_params, cache_salt?}` with an `X-Session-ID` header; from the answer `request_id`, `usage`, and
`choices[0]` `token_ids`, `finish_reason` and `logprobs.content[i]` whose `token` must be
`"token_id:<id>"` and whose `logprob` must be a finite number other than -9999.0. `client_reads` below
applies the client's own checks. One replica and one router for the module.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from burstrl.protocol import process
from burstrl.protocol.blocks import cache_scope, prefix_block_hashes
from burstrl.router.server import first_call_tokens, prompt_blocks
from tests.http_client import HTTP

from .conftest import start_server, stop_server

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` (<= 2 min) does not

TOKEN = "generate-cluster-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PATH = "/inference/v1/generate"
VOCAB = 2048  # the tiny model's
# What verifiers' TrainClient sends on every call: the renderer's stop ids, logprobs=1, skip_special_tokens=false.
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4, "stop_token_ids": [2], "logprobs": 1,
            "skip_special_tokens": False, "seed": 11}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("generate")
    server = start_server(tiny_model_dir, root / "replica", "--server.cluster_token", TOKEN)
    router = None
    try:
        router = process.start_router(root / "router", "--cluster_token", TOKEN, "--scrape_s", "0.5",
                                      "--replicas", json.dumps([server.url]))
        yield router.url, server
    finally:
        if router is not None:
            router.stop()
        stop_server(server)


def generate(url: str, session: str | None, ids: list[int], status: int = 200, **kw) -> dict:
    body = {"model": "base", "token_ids": ids, "sampling_params": {**SAMPLING, **kw.pop("sampling", {})}, **kw}
    headers = {"X-Session-ID": session} if session else {}
    r = HTTP.post(url + PATH, json=body, headers=headers, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def client_reads(answer: dict) -> tuple[list[int], list[float], str]:
    """What renderers.client.generate takes from an answer, with its checks (it raises on any failing)."""
    assert isinstance(answer["request_id"], str) and answer["request_id"]
    choice = answer["choices"][0]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert len(content) == len(ids) >= 1
    logprobs = []
    for token, entry in zip(ids, content, strict=True):
        assert entry["token"] == f"token_id:{token}"
        lp = entry["logprob"]
        assert isinstance(lp, float) and math.isfinite(lp) and lp != -9999.0
        logprobs.append(lp)
    assert choice["finish_reason"] in ("stop", "length")
    return ids, logprobs, choice["finish_reason"]


def test_a_multi_turn_session_through_the_router_is_captured_as_answered(cluster) -> None:
    router, server = cluster
    prompts, answers = [list(range(40, 90))], []
    for turn in range(3):
        extra = {} if turn == 0 else {"routed_experts_prompt_start": len(prompts[-1]) - 1}  # verifiers' bridge key
        answer = generate(router, "vf-multi", prompts[-1], sampling=extra)
        answers.append(client_reads(answer))
        assert answer["usage"]["prompt_tokens"] == len(prompts[-1])
        assert answer["meta_info"]["weight_version"] == "base"
        prompts.append(prompts[-1] + answers[-1][0] + [100 + turn, 101 + turn])
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # the session's own cache
    for where, headers in ((router, AUTH), (server.url, server.admin())):
        r = HTTP.get(where + "/v1/traces/vf-multi?full=true", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        calls = r.json()["calls"]
        assert [c["prompt_ids"] for c in calls] == prompts[:3]
        assert [c["completion_ids"] for c in calls] == [a[0] for a in answers]
        assert [c["logprobs"] for c in calls] == [a[1] for a in answers]  # exactly, not approximately
        assert [c["finish_reason"] for c in calls] == [a[2] for a in answers]
        assert not any(c["diverged"] for c in calls)
    card = HTTP.get(server.url + "/v1/models", timeout=30).json()["data"][0]  # the client's length check reads it
    assert isinstance(card["max_model_len"], int) and card["max_model_len"] > len(prompts[-1])
    direct = generate(server.url, "vf-direct", prompts[0], sampling={"logprobs": 0})
    ids, lps, _ = client_reads(direct)
    assert direct["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    call = server.get("/v1/traces/vf-direct")["calls"][0]
    assert (call["request_id"], call["completion_ids"], call["logprobs"]) == (direct["request_id"], ids, lps)


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_scopes_prefix_sharing(cluster) -> None:
    router, server = cluster
    prompt = list(range(300, 400))  # three full 32-token blocks
    generate(router, "salt-a", prompt, cache_salt="tenant-a")
    assert cached(generate(router, "salt-b", prompt, cache_salt="tenant-b")) == 0
    assert cached(generate(router, "no-salt", prompt)) == 0
    assert cached(generate(router, "salt-a2", prompt, cache_salt="tenant-a")) >= 64  # shared within one salt
    blocks = set(server.get("/v1/loads")["prefix_blocks"]["hashes"])
    salted = prompt_blocks({"token_ids": prompt, "cache_salt": "tenant-a"}, "base")
    assert salted == tuple(prefix_block_hashes(prompt, cache_scope("base", "tenant-a")))
    assert set(salted[:2]) <= blocks  # the router's index keys are the replica's
    assert first_call_tokens({"token_ids": prompt, "sampling_params": {"max_tokens": 7}}) == 107
    generate(router, "bad-salt", prompt, status=400, cache_salt="")


@pytest.mark.parametrize("target", ["replica", "router"])
def test_bad_calls_are_400s_naming_the_cause_and_the_replica_serves_on(cluster, target: str) -> None:
    router, server = cluster
    url = server.url if target == "replica" else router
    cases = [
        ({"token_ids": [5, VOCAB]}, "token ids must be in [0, 2048)"),
        ({"token_ids": [5, -1]}, "token ids must be in [0, 2048)"),
        ({"sampling": {"frobnicate": 1}}, "sampling_params.frobnicate"),
        ({"sampling": {"prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
        ({"sampling": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"sampling": {"logprobs": 21}}, "sampling_params.logprobs"),
        ({"sampling": {"n": 0}}, "n must be an integer"),
        ({"stream": True}, "stream"),
        ({"max_tokens": 3}, "max_tokens belongs in sampling_params"),
        ({"token_ids": []}, "token_ids"),
    ]
    for kw, needle in cases:
        ids = kw.pop("token_ids", [5, 6, 7])
        error = generate(url, f"bad-{target}", ids, status=400, **kw)["error"]
        assert needle in error["message"], (kw, error)
        generate(url, None, [5, 6, 7])  # serves on
    raw = {"missing token_ids": json.dumps({"model": "base", "sampling_params": {}}).encode(),
           "non-JSON": b"{not json", "array": b"[1, 2]"}
    for what, body in raw.items():
        r = HTTP.post(url + PATH, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "error" in r.json(), (what, r.text)
    assert "token_ids" in HTTP.post(url + PATH, content=raw["missing token_ids"], timeout=60).json()["error"]["message"]
    huge = b'{"model": "base", "token_ids": [' + b"5," * (4 << 20) + b'5]}'  # 8 MB + a little
    try:
        r = HTTP.post(url + PATH, content=huge, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413, r.text
    except httpx.RemoteProtocolError:  # refused while still sending: the connection is closed on us
        pass
    client_reads(generate(url, "after-errors-" + target, [5, 6, 7]))


@pytest.mark.slow  # imports verifiers' renderers (and a tokenizer): the fast lane keeps the hand-written calls
def test_verifiers_own_train_client_generates_two_turns_captured_exactly(cluster, tiny_model_dir: Path) -> None:
    """Not a hand-written request: `renderers.client.generate`, the code verifiers' TrainClient
    calls, renders the chat with the model's own template, sends its body and parses our answer
    with its own checks; two turns of one session with a cache salt, each captured exactly as
    answered (ids and logprobs)."""
    pytest.importorskip("renderers", reason="verifiers' renderers package: pip install 'burstrl[verifiers]'")
    import asyncio

    from openai import AsyncOpenAI
    from renderers import DefaultRendererConfig, create_renderer
    from transformers import AutoTokenizer

    url, _ = cluster
    renderer = create_renderer(AutoTokenizer.from_pretrained(tiny_model_dir), DefaultRendererConfig())
    from renderers.client import generate as vf_generate

    async def two_turns() -> list[dict]:
        sdk = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is 3 + 4?"}]
        out = []
        for turn in range(2):
            answer = await vf_generate(client=sdk, renderer=renderer, messages=messages, model="base",
                                       sampling_params={"temperature": 1.0, "max_tokens": 5, "seed": 3 + turn},
                                       cache_salt="run-7", extra_headers={"X-Session-ID": "vf-train-client"})
            out.append(answer)
            messages += [{"role": "assistant", "content": answer["content"] or ""},
                         {"role": "user", "content": "And 5 + 6?"}]
        await sdk.close()
        return out

    answers = asyncio.run(two_turns())
    trace = HTTP.get(f"{url}/v1/traces/vf-train-client?full=true", headers=AUTH, timeout=30).json()
    assert len(trace["calls"]) == 2
    for answer, call in zip(answers, trace["calls"], strict=True):
        assert call["prompt_ids"] == answer["prompt_ids"] and call["completion_ids"] == answer["completion_ids"]
        assert [round(x, 5) for x in call["logprobs"]] == [round(x, 5) for x in answer["completion_logprobs"]]
    assert len(answers[0]["completion_ids"]) >= 1
