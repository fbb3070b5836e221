"""The router's tenant layer (`router.tenancy`): who a caller is, and which sessions and versions it reaches.

Network-free: a `Registry` fed scrapes as the router's cluster token sees them (every version as
stored, `<tenant>~<name>`). The live attacks through a router are tests/security/test_router_tenants.py.
"""

from __future__ import annotations

import pytest

from burstrl.protocol.tenants import tenant_token
from burstrl.router import tenancy
from burstrl.router.registry import Registry, RouteError
from burstrl.router.server import prompt_blocks

KEY, CLUSTER = "router-tenancy-key", "router-cluster"
A, B = tenant_token(KEY, "run-a"), tenant_token(KEY, "run-b")
STORED = ("base", "run-a~policy-v1", "run-a~policy-v2", "run-b~policy-v9", "policy-v5")


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def fleet(reserved: tuple[str, ...] = STORED, on_demand: tuple[str, ...] = STORED) -> Registry:
    reg = Registry(seed=0)
    for url, pool, versions in (("http://r:1", "reserved", reserved), ("http://o:1", "on_demand", on_demand)):
        reg.add(url, pool)
        reg.apply_scrape(url, {"max_total_num_tokens": 10_000, "versions": list(versions)},
                         {"data": [{"id": v} for v in versions]})
    return reg


def caller(token: str) -> tenancy.RouteCaller:
    return tenancy.generating(KEY, auth(token))


def test_without_a_key_everyone_is_the_fleet() -> None:
    for headers in ({}, auth(A), auth("anything")):
        assert tenancy.generating("", headers) is tenancy.FLEET
        assert tenancy.reading("", CLUSTER, headers) is tenancy.FLEET
    f = tenancy.FLEET
    assert f.session("s1") == "s1" and f.session(None) is None
    assert f.version("policy-v1") == "policy-v1" and f.shown("run-a~x") == "run-a~x"
    assert f.salt("s") == "s" and f.say("session 'run-a~s'") == "session 'run-a~s'"
    # the forwarded headers are today's: no Authorization at all
    headers = {"content-type": "text/plain", "authorization": "Bearer x", "x-session-id": "s1", "cookie": "c"}
    assert f.upstream(headers) == {"content-type": "application/json", "x-session-id": "s1"}


def test_tokens_name_the_caller_or_are_refused() -> None:
    a = caller(A)
    assert a.tenant == "run-a" and a.authorization == f"Bearer {A}"
    mac_of_b = B.partition(".")[2]
    for headers in ({}, auth("run-a"), auth("run-a." + mac_of_b), auth(tenant_token("other-key", "run-a")),
                    auth(CLUSTER), {"authorization": A}):
        with pytest.raises(RouteError) as err:
            tenancy.generating(KEY, headers)
        assert err.value.status == 401 and err.value.kind == "authentication_error"
    # reading: the router's cluster token is the fleet, a tenant is itself, anyone else 401
    assert tenancy.reading(KEY, CLUSTER, auth(CLUSTER)) is tenancy.FLEET
    assert tenancy.reading(KEY, CLUSTER, auth(B)).tenant == "run-b"
    with pytest.raises(RouteError) as err:
        tenancy.reading(KEY, CLUSTER, {})
    assert err.value.status == 401


def test_a_tenants_call_goes_upstream_with_its_own_bearer_only() -> None:
    headers = {"authorization": f"Bearer {A}", "x-session-id": "s1", "x-burstrl-admin": CLUSTER}
    assert caller(A).upstream(headers) == {"content-type": "application/json", "x-session-id": "s1",
                                          "authorization": f"Bearer {A}"}


def test_names_map_into_the_tenants_namespace() -> None:
    a = caller(A)
    assert a.session("s1") == "run-a~s1" and a.session(None) is None
    assert a.version("policy-v1") == "run-a~policy-v1"
    assert a.version("base") == "base" and a.version("latest") == "latest" and a.version("") == ""
    assert a.version("run-b~policy-v9") == "run-a~run-b~policy-v9"  # never another tenant's
    assert a.shown("run-a~policy-v1") == "policy-v1" and a.shown("base") == "base"
    assert a.visible(set(STORED)) == ["base", "policy-v1", "policy-v2"]
    assert tenancy.FLEET.visible(set(STORED)) == sorted(STORED)
    assert a.salt(None) == "run-a~" and a.salt("x") == "run-a~x"
    assert a.say("session 'run-a~s1' is pinned to 'run-a~policy-v1'") == "session 's1' is pinned to 'policy-v1'"


def test_latest_is_the_newest_of_the_tenants_own_versions_every_pool_serves() -> None:
    reg = fleet(on_demand=("base", "run-a~policy-v1", "run-b~policy-v9", "policy-v5"))
    a, b = caller(A), caller(B)
    assert tenancy.resolve(reg, a, "run-a~s", "latest") == "run-a~policy-v1"  # v2 only on the reserved pool
    assert tenancy.resolve(reg, b, "run-b~s", "") == "run-b~policy-v9"
    assert tenancy.resolve(reg, tenancy.FLEET, "s", "latest") == "run-b~policy-v9"  # the fleet: every name
    c = caller(tenant_token(KEY, "run-c"))
    assert tenancy.resolve(reg, c, "run-c~s", "latest") == "base"  # nothing of its own: base, not v5 or v9
    assert tenancy.resolve(reg, a, None, "policy-v2") == "run-a~policy-v2"


def test_a_pinned_session_stays_pinned_and_another_tenants_id_is_a_new_session() -> None:
    reg = fleet()
    a, b = caller(A), caller(B)
    version = tenancy.resolve(reg, a, "run-a~s", "policy-v1")
    home = reg.place("run-a~s", version)
    assert reg.pinned["run-a~s"] == "run-a~policy-v1" and reg.homes["run-a~s"] == home.id
    assert tenancy.resolve(reg, a, "run-a~s", "latest") == "run-a~policy-v1"
    with pytest.raises(RouteError) as err:
        tenancy.resolve(reg, a, "run-a~s", "policy-v2")
    assert err.value.status == 409 and a.say(err.value.message) == \
        "session 's' is pinned to 'policy-v1', not 'policy-v2'"
    # B's `s` is not A's: its own latest, no pin of A's; and its samples `s/0` are not adopted from A
    assert tenancy.resolve(reg, b, "run-b~s", "latest") == "run-b~policy-v9"
    assert tenancy.resolve(reg, b, "run-b~s/0", "latest") == "run-b~policy-v9"
    assert "run-b~s/0" not in reg.homes
    assert tenancy.resolve(reg, a, "run-a~s/0", "latest") == "run-a~policy-v1"  # control: A's sample is A's
    assert reg.homes["run-a~s/0"] == home.id


def test_a_missing_version_is_a_404_naming_only_the_callers_versions() -> None:
    reg = fleet()
    b = caller(B)
    for model in ("policy-v1", "run-a~policy-v1"):
        with pytest.raises(RouteError) as err:
            tenancy.check_served(reg, b, "run-b~s", tenancy.resolve(reg, b, "run-b~s", model), model)
        assert err.value.status == 404 and "run-a" not in err.value.message.replace(model, "")
        assert err.value.message.endswith("served: ['base', 'policy-v9']")
    tenancy.check_served(reg, b, "run-b~s", "run-b~policy-v9", "policy-v9")  # control: its own is served
    tenancy.check_served(reg, tenancy.FLEET, "s", "nope", "nope")  # the fleet keeps the registry's answer


def test_prompt_blocks_hash_a_tenants_prompt_as_its_replica_does() -> None:
    body = {"input_ids": list(range(64)), "cache_salt": "x"}
    a = caller(A)
    assert prompt_blocks(body, "base") == prompt_blocks({**body, "cache_salt": "x"}, "base", tenancy.FLEET)
    assert prompt_blocks(body, "run-a~policy-v1", a) == \
        prompt_blocks({**body, "cache_salt": "run-a~x"}, "run-a~policy-v1")
    assert prompt_blocks(body, "base", a) != prompt_blocks(body, "base", caller(B))


def test_a_scrape_may_list_a_tenants_sessions_by_their_stored_names() -> None:
    """The router scrapes with its cluster token, to which a tenanted replica lists `<tenant>~<sid>`."""
    from burstrl.router.answers import BadAnswer, check_loads

    listed = check_loads({"sessions": [{"session_id": "run-a~s1/0"}, {"session_id": "s2"}]})["sessions"]
    assert [s["session_id"] for s in listed] == ["run-a~s1/0", "s2"]
    for sid in ("run-a~b~c", "~s1", "Run-A~s1"):
        with pytest.raises(BadAnswer):
            check_loads({"sessions": [{"session_id": sid}]})
