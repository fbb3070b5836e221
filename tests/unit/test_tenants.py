"""Tenant tokens and names (protocol/tenants.py) and the replica's caller mapping (inference/tenancy.py)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from burstrl.inference.adapters import SCOPED_NAME
from burstrl.inference.api_common import ApiError
from burstrl.inference.tenancy import ANONYMOUS, FLEET, Caller
from burstrl.protocol.http import SESSION_ID
from burstrl.protocol.tenants import (
    SCOPED_SESSION_ID,
    TenantError,
    check_name,
    local,
    owner,
    scoped,
    scoped_salt,
    tenant_of,
    tenant_token,
)

KEY = "fleet-secret"


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_token_is_name_dot_hmac_and_verifies() -> None:
    token = tenant_token(KEY, "run-a")
    assert token == "run-a." + hmac.new(KEY.encode(), b"run-a", hashlib.sha256).hexdigest()
    assert tenant_of(bearer(token), KEY) == "run-a"
    assert tenant_of({"authorization": f"bearer {token}"}, KEY) == "run-a"  # the scheme is case-insensitive


@pytest.mark.parametrize("headers", [
    {},
    {"authorization": ""},
    {"authorization": "Bearer"},
    {"authorization": "Bearer run-a"},  # no MAC
    {"authorization": "Bearer run-a."},  # empty MAC
    {"authorization": "Basic " + tenant_token(KEY, "run-a")},
    {"authorization": "Bearer " + tenant_token(KEY, "run-a")[:-1] + "0"},  # one hex digit changed (or same)
    {"authorization": "Bearer " + tenant_token(KEY, "run-a").upper()},  # a name with capitals is no name
    {"authorization": "Bearer run-b." + tenant_token(KEY, "run-a").partition(".")[2]},  # another's MAC
    {"authorization": "Bearer " + tenant_token("other-key", "run-a")},  # minted with another key
    {"authorization": "Bearer " + "x" * 40 + "." + "0" * 64},  # name too long
    {"authorization": "Bearer ~a." + "0" * 64},
    {"authorization": "Bearer run-a.\u00e9\u00e9"},  # non-ASCII MAC: refused, not an exception
])
def test_malformed_or_forged_tokens_name_no_tenant(headers: dict[str, str]) -> None:
    token = tenant_token(KEY, "run-a")
    if headers.get("authorization") == f"Bearer {token}":  # the digit "changed" to itself
        return
    assert tenant_of(headers, KEY) is None


def test_no_key_means_no_tenants() -> None:
    assert tenant_of(bearer(tenant_token(KEY, "run-a")), "") is None
    with pytest.raises(TenantError, match="empty"):
        tenant_token("", "run-a")


@pytest.mark.parametrize("name", ["a", "run-1", "0abc", "a" * 32, "x-y-z"])
def test_valid_tenant_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "A", "run_a", "a" * 33, "a~b", "a.b", "a b", "é"])
def test_invalid_tenant_names_say_what_a_name_is(name: str) -> None:
    with pytest.raises(TenantError, match=r"1-32 characters of \[a-z0-9-\]"):
        check_name(name)
    with pytest.raises(TenantError):
        tenant_token(KEY, name)


def test_scoping_maps_names_into_the_tenant_namespace_and_back() -> None:
    assert scoped("a", "s1") == "a~s1" and scoped(None, "s1") == "s1"
    assert local("a~policy-v3") == "policy-v3" and local("policy-v3") == "policy-v3"
    assert owner("a~policy-v3") == "a" and owner("policy-v3") is None
    assert scoped_salt("a", None) == "a~" and scoped_salt("a", "x") == "a~x"
    assert scoped_salt(None, None) is None and scoped_salt(None, "x") == "x"  # no tenancy: unchanged
    # every client session id is a valid key, in no namespace or in one; `~` comes only from us
    assert SCOPED_SESSION_ID.fullmatch("a~sid/0") and SCOPED_SESSION_ID.fullmatch("sid")
    assert not SESSION_ID.fullmatch("a~sid") and not SCOPED_SESSION_ID.fullmatch("a~b~sid")
    assert SCOPED_NAME.fullmatch("a~policy-v3") and not SCOPED_NAME.fullmatch("a~b~policy-v3")


def test_a_tenant_caller_reaches_its_own_namespace_only() -> None:
    a = Caller("a", fleet=False)
    assert a.session("s1") == "a~s1" and a.session(None) is None
    assert a.version("base", "base") == "base" and a.version("policy-v1", "base") == "a~policy-v1"
    assert a.salt(None) == "a~" and a.name("x") == "a~x"
    with pytest.raises(ApiError) as err:  # a client can never name another namespace
        a.session("b~s1")
    assert err.value.status == 400
    names = ["policy-v1", "a~policy-v1", "b~policy-v1", "a~policy-v2"]
    assert a.visible(names) == ["policy-v1", "policy-v2"]
    assert FLEET.visible(names) == names and ANONYMOUS.visible(names) == []
    assert a.say("session 'a~s1' is pinned to 'a~policy-v1'") == "session 's1' is pinned to 'policy-v1'"


def test_the_fleet_caller_changes_nothing() -> None:
    """Tenancy off (or the admin token): every name is used as the client sent it, as before tenants."""
    assert FLEET.session("s1") == "s1" and FLEET.version("policy-v1", "base") == "policy-v1"
    assert FLEET.salt(None) is None and FLEET.salt("x") == "x" and FLEET.say("a~b") == "a~b"
