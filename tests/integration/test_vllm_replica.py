"""Replicas on vLLM (`engine.backend = "vllm"`): Gemma 3 270M served by vLLM under burstrl's server.

One replica serves the module (vLLM's start is most of the cost). What it shows: captured logprobs
equal an fp32 HF forward (base model, and two LoRA versions served at once) within 1e-4 over a
session past the 512-token sliding window; versions never share KV (cached tokens); an aborted
call keeps its tokens so far in the capture; loads come from vLLM's own figures; hostile requests
get the own engine's answers; an unloaded version's files go; and when vLLM dies the replica
answers 503 and exits for the fleet to replace it (last: it ends the module's replica).

Needs vLLM's environment (`make vllm`; `.ci/run` makes it): without it the module skips, saying so.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from burstrl.protocol.process import start_replica
from tests.http_client import HTTP
from tests.vllm_env import require_vllm, vllm_slot

from .conftest import ADMIN_TOKEN, Server, stop_server
from .test_gemma import captured_vs_reference, complete, load_versions, make_reference

pytestmark = pytest.mark.slow
FP32_TOL = 2.5e-4  # max |captured - fp32 HF| logprob (the own engine: < 1e-4 on the same prompts)


@pytest.fixture(scope="module")
def server(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory):
    require_vllm()
    work = tmp_path_factory.mktemp("vllm-replica")
    with vllm_slot():
        rep = start_replica(gemma_model, work, "--server.admin_token", ADMIN_TOKEN, "--server.state_dir",
                            str(work / "state"), "--engine.backend", "vllm", "--engine.max_model_len", "2048",
                            "--engine.vllm.kv_cache_gib", "1", "--server.dead_engine_exit_s", "2", timeout=900)
        srv = Server(url=rep.url, replica=rep)
        yield srv
        stop_server(srv)


@pytest.fixture(scope="module")
def reference(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """test_gemma's: an fp32 HF load with two random rank-8 LoRA versions saved as PEFT."""
    return make_reference(gemma_model, tmp_path_factory.mktemp("vllm-lora"))


def test_vllm_engine_serves_the_model_and_captures_exact_logprobs_past_the_window(server: Server,
                                                                                 reference) -> None:
    assert HTTP.get(server.url + "/v1/models", timeout=30).json()["engine_path"] == "vllm"
    assert "vLLM proven on a 24-token probe (float32" in Path(server.replica.log).read_text()
    answer = complete(server, "Question: What is 12 + 7?\nAnswer:", max_tokens=12, temperature=0)
    assert "19" in answer["choices"][0]["text"], answer["choices"][0]["text"]
    story = " ".join(f"Line {i}: the robot counted {i * 7 % 13} bolts." for i in range(80))  # ~800 tokens
    first = complete(server, story, session="vllm-window", max_tokens=12, temperature=1.0, seed=1)
    second_prompt = story + first["choices"][0]["text"] + " Then the robot said:"
    complete(server, second_prompt, session="vllm-window", max_tokens=12, temperature=0.7, top_p=0.9, seed=2)
    calls = server.get("/v1/traces/vllm-window?full=true")["calls"]
    assert len(calls) == 2 and len(calls[0]["prompt_ids"]) > 512 + 128
    assert calls[1]["cached_tokens"] > 512  # vLLM's prefix cache resumed the session
    model, _ = reference
    with model.disable_adapter():
        # fp32 on both sides; vLLM's CPU kernels sum in another order: 1.2e-4 measured on this prompt
        assert captured_vs_reference(model, calls[:1]) < FP32_TOL
        # T=0.7, top-p 0.9: processed logprobs are of the tempered nucleus, renormalised
        tempered = _tempered_reference(model, calls[1], 0.7, 0.9)
        assert (torch.tensor(calls[1]["logprobs"]) - tempered).abs().max().item() < 1e-3


def _tempered_reference(model, call: dict, temperature: float, top_p: float) -> torch.Tensor:
    """The sampled tokens' logprobs under softmax(logits / T) cut to the top-p nucleus and renormalised."""
    ids, start = call["prompt_ids"] + call["completion_ids"], len(call["prompt_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    probs, order = logp.exp().sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    kept = torch.zeros_like(logp, dtype=torch.bool).scatter(1, order, before < top_p)
    nucleus = torch.where(kept, logp, torch.full_like(logp, float("-inf"))).logsumexp(dim=-1)
    return logp.gather(1, torch.tensor(ids[start:])[:, None])[:, 0] - nucleus


def test_two_versions_at_once_exact_and_never_sharing_kv(server: Server, reference) -> None:
    model, dirs = reference
    load_versions(server, dirs)
    prompt = "def fibonacci(n):\n    " + "".join(f"# step {i}: add the two previous numbers\n    " for i in range(12))
    complete(server, prompt, session="v1-a", model="policy-v1", max_tokens=8, temperature=1.0, seed=3)
    runs = [("v2-a", "policy-v2", prompt), ("v1-b", "policy-v1", prompt + "return")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: complete(server, r[2], session=r[0], model=r[1], max_tokens=16,
                                         temperature=1.0, seed=4), runs))
    traces = {sid: server.get(f"/v1/traces/{sid}?full=true")["calls"] for sid in ("v1-a", "v2-a", "v1-b")}
    assert traces["v1-b"][0]["cached_tokens"] >= 64  # v1-a's prompt blocks, same version
    assert traces["v2-a"][0]["cached_tokens"] == 0  # the same prompt under another version: nothing shared
    worst = {}
    for version, sids in (("policy-v1", ("v1-a", "v1-b")), ("policy-v2", ("v2-a",))):
        model.set_adapter(version)
        worst[version] = captured_vs_reference(model, [c for sid in sids for c in traces[sid]])
    assert max(worst.values()) < FP32_TOL, worst
    model.set_adapter("policy-v1")  # a wrong version's numbers are far off: the check can fail
    assert captured_vs_reference(model, traces["v2-a"]) > 1e-3


def test_an_aborted_call_keeps_its_tokens_in_the_capture(server: Server) -> None:
    body = {"model": "base", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 1.0, "seed": 5,
            "stream": True, "session_id": "vllm-abort", "ignore_eos": True}
    with HTTP.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen >= 4:
                break
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        trace = server.get("/v1/traces/vllm-abort?full=true")
        if not trace["busy"] and trace["calls"]:
            break
        time.sleep(0.2)
    call = trace["calls"][0]
    assert call["finish_reason"] == "abort"
    assert 0 < len(call["completion_ids"]) < 400 and len(call["logprobs"]) == len(call["completion_ids"])


def test_loads_and_metrics_come_from_vllm(server: Server) -> None:
    loads = server.get("/v1/loads")
    assert loads["engine"] == "vllm" and loads["max_total_num_tokens"] > 2048
    assert loads["prefix_cache_queries_tokens"] > 0 and 0.0 <= loads["token_usage"] <= 1.0
    assert {s["session_id"] for s in loads["sessions"]} >= {"vllm-window", "v1-a"}
    assert server.metric("vllm:prefix_cache_hits_total") > 0


def test_hostile_requests_get_the_same_answers_as_on_the_own_engine(server: Server) -> None:
    url = server.url + "/v1/completions"
    cases = [({"prompt": [5, 10 ** 9]}, 400), ({"prompt": "hi", "n": 0}, 400), ({"prompt": "hi", "n": 2, "stream": True}, 400), ({"prompt": "hi", "model": "nope"}, 404),
             ({"prompt": "hi", "max_tokens": 10 ** 6}, 400), ({"prompt": "hi", "temperature": -1}, 400),
             ({"prompt": ["5", True, 7.0]}, 400), ({"prompt": "hi", "logit_bias": {"999999999": 5}}, 400)]
    for extra, status in cases:
        r = HTTP.post(url, json={"model": "base", "max_tokens": 2, **extra}, timeout=60)
        assert r.status_code == status, (extra, r.status_code, r.text)
    assert complete(server, "Still serving?", max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_an_unloaded_version_leaves_vllm_and_its_files_go(server: Server) -> None:
    versions = Path(server.replica.log).parent / "state" / "vllm-versions"
    before = {p.name for p in versions.iterdir()}
    assert any(n.startswith("policy-v2@") for n in before), before
    for sid in ("v2-a",):
        HTTP.delete(server.url + f"/v1/traces/{sid}", headers=server.admin(), timeout=30)
    r = HTTP.post(server.url + "/v1/unload_lora_adapter", headers=server.admin(), timeout=60,
                  json={"lora_name": "policy-v2"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while any(p.name.startswith("policy-v2@") for p in versions.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(p.name.startswith("policy-v2@") for p in versions.iterdir())
    r = HTTP.post(server.url + "/v1/completions", json={"model": "policy-v2", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 404


def test_n_samples_in_one_request_on_vllm(server: Server, reference) -> None:
    """n = 3 as on the own engine: sample i seeded seed + i, captured as `<sid>/i`, exact."""
    body = {"model": "base", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 7,
            "n": 3, "session_id": "vgroup", "logprobs": 0, "return_token_ids": True}
    out = HTTP.post(server.url + "/v1/completions", json=body, timeout=300).json()
    assert out["meta_info"]["session_ids"] == ["vgroup/0", "vgroup/1", "vgroup/2"]
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1
    calls = [server.get(f"/v1/traces/vgroup/{i}?full=true")["calls"][0] for i in range(3)]
    assert [c["completion_ids"] for c in calls] == [c["token_ids"] for c in out["choices"]]
    model, _ = reference
    with model.disable_adapter():
        assert captured_vs_reference(model, calls) < FP32_TOL
    alone = HTTP.post(server.url + "/v1/completions", timeout=300,
                      json={**body, "n": 1, "seed": 8, "session_id": "vgroup-b"}).json()
    assert alone["choices"][0]["token_ids"] == out["choices"][1]["token_ids"]


def test_when_vllm_dies_the_replica_answers_503_and_exits(server: Server) -> None:
    log = Path(server.replica.log).read_text()
    pid = int(re.findall(r"vLLM starting \(pid (\d+)", log)[-1])
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    status = None
    while time.monotonic() < deadline and server.replica.poll() is None:
        try:
            status = HTTP.get(server.url + "/health", timeout=5).status_code
        except Exception:  # noqa: BLE001 - the replica may be gone between polls
            break
        if status == 503:
            break
        time.sleep(0.1)
    assert status == 503
    server.replica.proc.wait(timeout=60)
    assert server.replica.poll() is not None
