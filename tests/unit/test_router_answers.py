"""A replica's scrape answers are checked before the router trusts them (issue 36, item 2).

The regressions: a session reported with 10**400 tokens made every placement raise OverflowError,
and `1e999` or JSON nested 100k deep raised out of the scrape. Whatever numbers an answer holds,
either the schema refuses it (naming the field) or placement, stats and /metrics work on it.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstrl.router.answers import MAX_TOKENS, BadAnswer, check_answers, check_loads
from burstrl.router.metrics import prometheus_text
from burstrl.router.registry import Registry, RouteError

MODELS = json.dumps({"object": "list", "data": [{"id": "base"}]}).encode()
SANE = {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 120, "max_total_num_tokens": 65536,
        "token_usage": 0.01, "cache_hit_rate": 0.25, "prefix_cache_queries_tokens": 10, "prefix_cache_hit_tokens": 2,
        "evictions": 0, "thrash": 0, "num_sessions": 1, "versions": ["base", "policy-v1"],
        "sessions": [{"session_id": "s1", "version": "base", "tokens": 120, "context_tokens": 130, "busy": False}],
        "prefix_blocks": {"block_tokens": 32, "hashes": [1, 2**63 - 1]}, "retiring_versions": []}


def with_session(**fields) -> dict:
    return {**SANE, "sessions": [{**SANE["sessions"][0], **fields}]}


def test_a_replicas_own_answer_passes_and_keeps_what_the_registry_reads() -> None:
    loads, models = check_answers(json.dumps(SANE).encode(), MODELS)
    assert loads["sessions"] == SANE["sessions"] and loads["prefix_blocks"] == {"hashes": [1, 2**63 - 1]}
    assert loads["num_used_tokens"] == 120 and loads["cache_hit_rate"] == 0.25 and models["data"] == [{"id": "base"}]
    assert "sessions" not in check_loads({"num_used_tokens": 0})  # listed to nobody: stays unlisted
    assert check_loads({})["max_total_num_tokens"] == 0  # what is missing keeps the old defaults
    assert "kv_window" not in check_loads({"kv_window": None})  # full-attention KV: no window
    assert check_loads({"kv_window": {"tokens": 640, "fraction": 5 / 6}})["kv_window"] == (640, 5 / 6)


@pytest.mark.parametrize("raw, field", [
    (json.dumps(with_session(tokens=10**400)).encode(), "sessions[0].tokens"),
    (json.dumps({**SANE, "num_used_tokens": float("inf")}).encode(), "num_used_tokens"),
    (b'{"num_used_tokens": 1e999}', "num_used_tokens"),
    (b'{"max_total_num_tokens": NaN}', "max_total_num_tokens"),
    (b'{"cache_hit_rate": 2.5}', "cache_hit_rate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"x": ' + b"[" * 100_000, "nested too deeply"),
    (b'{"num_used_tokens": ' + b"9" * 5000 + b"}", "not JSON"),
    (b"\xff\xfe garbage", "not JSON"),
    (json.dumps(with_session(session_id="a b")).encode(), "session_id"),
    (json.dumps(with_session(busy="yes")).encode(), "busy"),
    (json.dumps({**SANE, "sessions": {"s1": 1}}).encode(), "sessions must be a list"),
    (json.dumps({**SANE, "versions": ["x" * 300]}).encode(), "versions[0]"),
    (json.dumps({**SANE, "prefix_blocks": {"hashes": [2**70]}}).encode(), "prefix_blocks.hashes"),
    (json.dumps({**SANE, "num_running_reqs": -1}).encode(), "num_running_reqs"),
    (json.dumps({**SANE, "evictions": True}).encode(), "evictions"),
    (json.dumps({**SANE, "kv_window": {"tokens": 640, "fraction": 1.5}}).encode(), "kv_window.fraction"),
    (json.dumps({**SANE, "kv_window": {"tokens": -1, "fraction": 0.5}}).encode(), "kv_window.tokens"),
    (json.dumps({**SANE, "kv_window": {"fraction": 0.5}}).encode(), "kv_window.tokens"),
    (b'{"kv_window": {"tokens": 640, "fraction": NaN}}', "kv_window.fraction"),
    (json.dumps({**SANE, "kv_window": [640, 0.5]}).encode(), "kv_window must be a JSON object"),
    (b"[]", "JSON object"),
])
def test_regression_nonsense_answers_are_refused_naming_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(BadAnswer, match=None) as info:
        check_answers(raw, MODELS)
    assert field in str(info.value) and len(str(info.value)) < 400


def test_models_answer_is_checked_too() -> None:
    for raw in (b'{"data": [{"id": 7}]}', b'{"data": "base"}', b'{"data": [' + b'{"id": "v"},' * 5000 + b'{"id": "v"}]}'):
        with pytest.raises(BadAnswer, match="data"):
            check_answers(json.dumps(SANE).encode(), raw)


def test_regression_a_huge_session_no_longer_fails_every_placement() -> None:
    """The finding, without the network: the old registry took 10**400 tokens and every placement raised."""
    reg = Registry(policy="kv", seed=0)
    for url in ("http://a:1", "http://b:1"):
        reg.add(url)
    reg.apply_scrape("http://a:1", *check_answers(json.dumps(SANE).encode(), MODELS))
    with pytest.raises(BadAnswer, match="tokens"):
        check_answers(json.dumps(with_session(tokens=10**400, session_id="huge")).encode(), MODELS)
    reg.reject("http://b:1", "sessions[0].tokens out of range")
    assert {reg.place(f"n{i}", "base").id for i in range(20)} == {"http://a:1"}
    assert reg.stats()["replicas"][1]["bad_reason"] == "sessions[0].tokens out of range"
    assert reg.counters.scrapes_rejected == 1


numbers = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, MAX_TOKENS, MAX_TOKENS + 1, 10**400]),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=3))
sessions = st.lists(st.fixed_dictionaries({"session_id": st.sampled_from(["s1", "s2", "s3"])},
                                          optional={"tokens": numbers, "context_tokens": numbers,
                                                    "busy": st.booleans(), "version": st.just("base")}), max_size=4)
hostile_loads = st.fixed_dictionaries({"versions": st.just(["base"])}, optional={
    "num_used_tokens": numbers, "max_total_num_tokens": numbers, "num_running_reqs": numbers,
    "num_waiting_reqs": numbers, "cache_hit_rate": numbers, "thrash": numbers, "evictions": numbers,
    "prefix_cache_hit_tokens": numbers, "prefix_cache_queries_tokens": numbers, "sessions": sessions,
    "prefix_blocks": st.fixed_dictionaries({"hashes": st.lists(numbers, max_size=3)}),
    "kv_window": st.one_of(st.none(), numbers, st.fixed_dictionaries({}, optional={"tokens": numbers,
                                                                                  "fraction": numbers}))})


@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(answers=st.lists(hostile_loads, min_size=1, max_size=3), policy=st.sampled_from(["kv", "headroom"]))
def test_placement_never_raises_on_any_number_a_replica_reports(answers: list[dict], policy: str) -> None:
    """Each answer is refused by the schema or applied; then placement, stats and /metrics never raise."""
    reg = Registry(policy=policy, seed=0)
    reg.add("http://good:1")
    reg.apply_scrape("http://good:1", *check_answers(json.dumps(SANE).encode(), MODELS))
    reg.add("http://odd:1")
    for i, loads in enumerate(answers):
        try:
            checked = check_answers(json.dumps(loads).encode(), MODELS)
        except BadAnswer as exc:
            reg.reject("http://odd:1", str(exc))
        else:
            reg.apply_scrape("http://odd:1", *checked)
        for j in range(3):
            try:
                reg.place(f"p{i}-{j}", "base", expected_tokens=j * 1000)
            except RouteError as exc:
                assert exc.status < 500 or exc.status == 503, exc.message
    prometheus_text(reg.stats())
