"""The vLLM engine's wire (`inference/vllm/wire.py`, `metrics.py`, `process.py`) without vLLM: what is
sent, how answers become tokens, and that a malformed answer is an error, never a wrong capture."""

from __future__ import annotations

import asyncio
import json

import pytest

from burstrl.config.vllm import VllmSection
from burstrl.inference.request import Request
from burstrl.inference.sampling import SamplingParams
from burstrl.inference.vllm import wire
from burstrl.inference.vllm.metrics import parse
from burstrl.inference.vllm.process import VllmStartError, server_argv, server_env, vllm_python


class _Session:
    id, ephemeral = "s", False


def _req(**params) -> Request:
    return Request(id="r1", session=_Session(), prompt_ids=[1, 2, 3], params=SamplingParams(**params),
                   version="base", adapter=None, on_done=lambda _: None)


def test_the_body_carries_every_sampling_setting_and_eos_as_stop_ids() -> None:
    req = _req(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=["\n"], stop_token_ids=[9],
               top_logprobs=2, logit_bias={4: 1.5})
    req.cache_salt = "salt"
    body = wire.generate_body(req, "policy-v1@7", {0, 1})
    s = body["sampling_params"]
    assert body["token_ids"] == [1, 2, 3] and body["model"] == "policy-v1@7" and body["cache_salt"] == "salt"
    assert (s["max_tokens"], s["temperature"], s["top_p"], s["top_k"], s["seed"]) == (7, 0.5, 0.9, 5, 3)
    assert s["stop_token_ids"] == [0, 1, 9] and s["logprobs"] == 3 and s["logit_bias"] == {"4": 1.5}
    base = wire.generate_body(_req(ignore_eos=True), None, {0})
    assert "model" not in base and base["sampling_params"]["stop_token_ids"] == []
    assert "top_k" not in base["sampling_params"] and base["sampling_params"]["logprobs"] == 0


def _events(*chunks: bytes) -> list:
    async def gen():
        for c in chunks:
            yield c

    async def collect():
        return [e async for e in wire.sse_events(gen())]

    return asyncio.run(collect())


def test_sse_events_split_across_chunks_and_stop_at_done() -> None:
    a, b = json.dumps({"x": 1}).encode(), json.dumps({"y": 2}).encode()
    assert _events(b"data: " + a[:3], a[3:] + b"\n\ndata: " + b + b"\n\n", b"data: [DONE]\n\ndata: {}\n\n") == [
        {"x": 1}, {"y": 2}]
    with pytest.raises(wire.WireError, match="malformed"):
        _events(b"data: {nope\n\n")
    with pytest.raises(wire.WireError, match="over"):
        _events(*[b"x" * (1 << 20)] * 17)


def _choice(ids, lps, finish=None, stop=None, tops=None):
    content = [{"token_id": t, "logprob": lp, "top_logprobs": (tops or {}).get(t, [])} for t, lp in zip(ids, lps, strict=False)]
    return {"choices": [{"token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish,
                         "stop_reason": stop}]}


def test_apply_adds_tokens_and_maps_an_added_eos_stop_back_to_none() -> None:
    req = _req(stop_token_ids=[9])
    assert wire.apply(req, _choice([5, 6], [-0.5, -1.0]), {0}, 100) == 2
    wire.apply(req, {**_choice([0], [-0.1], "stop", 0), "usage": {"prompt_tokens_details": {"cached_tokens": 2}}},
               {0}, 100)
    assert req.completion_ids == [5, 6, 0] and req.logprobs == [-0.5, -1.0, -0.1] == req.shown_logprobs
    assert req.finish_reason == "stop" and req.stop_reason is None and req.cached_tokens == 2
    user = _req(stop_token_ids=[9])
    wire.apply(user, _choice([9], [-0.2], "stop", 9), {0}, 100)
    assert user.stop_reason == 9


def test_top_logprobs_keep_the_k_best_whatever_vllm_adds() -> None:
    req = _req(top_logprobs=2)
    tops = {7: [{"token_id": 7, "logprob": -3.0, "rank": 9}, {"token_id": 1, "logprob": -0.1, "rank": 1},
                {"token_id": 2, "logprob": -2.5, "rank": 2}]}
    wire.apply(req, _choice([7], [-3.0], tops=tops), set(), 100)
    assert req.top_logprobs == [[(1, -0.1), (2, -2.5)]]


@pytest.mark.parametrize("event", [
    _choice([5, 6], [-0.5]),                       # ids and logprobs that do not pair up
    _choice([500], [-0.5]),                        # outside the vocabulary
    _choice([True], [-0.5]),                       # not an int
    _choice([5], [float("nan")]),                  # not a logprob
    _choice([5], [0.5]),                           # a probability above 1
    {"choices": [{"token_ids": [5], "logprobs": {"content": [{"token_id": 6, "logprob": -1.0}]}}]},
])
def test_a_malformed_answer_is_an_error_not_a_capture(event: dict) -> None:
    with pytest.raises(wire.WireError):
        wire.apply(_req(), event, set(), 100)


def test_metrics_parse_sums_engines_and_reads_the_cache_size() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running x", 'vllm:num_requests_running{engine="0"} 2.0',
        'vllm:num_requests_running{engine="1"} 1.0', 'vllm:num_requests_waiting{engine="0"} 4.0',
        'vllm:kv_cache_usage_perc{engine="0"} 0.25', 'vllm:prefix_cache_queries_total{engine="0"} 100.0',
        'vllm:prefix_cache_hits_total{engine="0"} 40.0', 'vllm:cache_config_info{block_size="128",kv_cache_size_tokens="55356"} 1.0',
        "garbage line", 'vllm:num_preemptions_total{engine="0"} nope'])
    f = parse(text)
    assert (f.running, f.waiting, f.usage, f.capacity_tokens) == (3, 4, 0.25, 55356)
    assert (f.prefix_queries, f.prefix_hits, f.preemptions, f.block_size) == (100.0, 40.0, 0.0, 128)
    assert parse("").block_size == 16  # vLLM's default until its cache config is read


def test_the_server_command_and_environment(tmp_path) -> None:
    cfg = VllmSection(cpu_cores="0-1", kv_cache_gib=3, extra_args=["--foo"])
    argv = server_argv("/py", "/m", "float32", 2048, tmp_path / "s.sock", "key", cfg, cpu=True)
    for flag in ("--enable-scale-out", "--enable-lora", "--enable-prompt-tokens-details"):
        assert flag in argv
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs" and argv[-1] == "--foo"
    assert "--gpu-memory-utilization" not in argv
    env = server_env(cfg, cpu=True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and "PYTHONPATH" not in env


def test_a_missing_vllm_environment_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("BURSTRL_VLLM_PYTHON", raising=False)
    with pytest.raises(VllmStartError, match="make vllm"):
        vllm_python(VllmSection(), default=tmp_path / "absent")
    with pytest.raises(VllmStartError, match="no such interpreter"):
        vllm_python(VllmSection(python=str(tmp_path / "nope")))
    real = tmp_path / "python"
    real.write_text("")
    assert vllm_python(VllmSection(python=str(real)), default=tmp_path / "absent") == str(real)


def test_the_start_probe_reads_prompt_logprobs_and_judges_by_dtype() -> None:
    from burstrl.inference.vllm import probe

    ids = [5, 6, 7]
    answer = {"prompt_logprobs": [None, {"6": {"logprob": -1.0, "rank": 1}}, {"7": {"logprob": -2.0, "rank": 3},
                                                                               "1": {"logprob": -0.5}}]}
    assert probe.engine_logprobs(answer, ids) == [-1.0, -2.0]
    for bad in ({"prompt_logprobs": None}, {"prompt_logprobs": [None, {"9": {"logprob": -1.0}}, None]},
                {"prompt_logprobs": [None, {"6": {"logprob": "x"}}, {"7": {"logprob": -1.0}}]}):
        with pytest.raises(ValueError):
            probe.engine_logprobs(bad, ids)
    assert probe.judge([-1.0, -2.0], [-1.0002, -2.0], "float32")[0] is None
    assert "max |dlogp|" in probe.judge([-1.0, -2.0], [-1.01, -2.0], "float32")[0]
    assert probe.judge([-1.0, -2.0], [-1.2, -2.1], "bfloat16")[0] is None
    assert "mean |dlogp|" in probe.judge([-1.0, -2.0], [-1.6, -2.5], "bfloat16")[0]
    assert probe.judge([float("nan"), -2.0], [-1.0, -2.0], "bfloat16")[0] == "NaN logprobs"
