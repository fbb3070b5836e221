"""burstrl.protocol: version names, session ids, bearer checks and the ready line, as every role reads them."""

from __future__ import annotations

import json

import pytest

from burstrl.protocol.http import bearer_matches, error_body, session_id_from
from burstrl.protocol.process import ready_url
from burstrl.protocol.versions import VERSION_NAME, version_key, version_name, version_number


def test_version_names_round_trip() -> None:
    assert version_name(7) == "policy-v7" and version_number("policy-v7") == 7
    assert version_number("base") == 0
    for bad in ("policy-v", "policy-vx", "v7", "policy-v-1", ""):
        with pytest.raises(ValueError):
            version_number(bad)
    assert VERSION_NAME.fullmatch("policy-v0") and VERSION_NAME.fullmatch("policy-v12")
    assert not VERSION_NAME.fullmatch("policy-v007") and not VERSION_NAME.fullmatch("base")


def test_versions_order_by_number_not_text() -> None:
    assert max(["policy-v9", "policy-v12", "base"], key=version_key) == "policy-v12"
    assert version_key("base") < version_key("policy-v1")


def test_session_id_comes_from_the_body_then_the_first_header_set() -> None:
    headers = {"x-smg-routing-key": "from-smg", "x-dynamo-session-id": "from-dynamo"}
    assert session_id_from("from-body", headers) == "from-body"
    assert session_id_from(None, headers) == "from-smg"
    assert session_id_from("", {"x-session-id": "", "x-dynamo-session-id": "d"}) == "d"
    assert session_id_from(123, {}) is None


def test_bearer_matches_any_given_token_and_never_an_empty_one() -> None:
    assert bearer_matches({"authorization": "Bearer admin"}, "admin", "cluster")
    assert bearer_matches({"authorization": "bearer cluster"}, "admin", "cluster")
    assert not bearer_matches({"authorization": "Bearer other"}, "admin", "cluster")
    assert not bearer_matches({"authorization": "Basic admin"}, "admin")
    assert not bearer_matches({}, "admin")
    assert not bearer_matches({"authorization": "Bearer "}, "")


def test_error_body_is_openai_shaped() -> None:
    assert error_body(404, "no such model", "not_found_error") == {
        "error": {"message": "no such model", "type": "not_found_error", "param": None, "code": 404}}


def test_ready_url_reads_only_the_ready_line() -> None:
    line = json.dumps({"event": "ready", "url": "http://127.0.0.1:8000", "pid": 1}) + "\n"
    assert ready_url(line) == "http://127.0.0.1:8000"
    assert ready_url("admin token written to /tmp/x\n") is None
    assert ready_url(json.dumps({"event": "other"})) is None
    assert ready_url("") is None
