import threading

import pytest

from burstrl.inference import sessions as sessions_mod
from burstrl.inference.sessions import SessionError, SessionTable


@pytest.fixture
def clock(fake_clock):
    return fake_clock(sessions_mod, now=500.0)


def _status(fn, *args):
    with pytest.raises(SessionError) as info:
        fn(*args)
    return info.value.status, str(info.value)


def test_begin_creates_and_marks_busy():
    table = SessionTable(ttl_s=60)
    s = table.begin("rollout-1", "policy-v1", "req-1")
    assert s.id == "rollout-1" and s.version == "policy-v1" and s.busy and not s.ephemeral
    assert table.get("rollout-1") is s
    assert table.snapshot() == [s]


def test_busy_session_conflicts_until_end():
    table = SessionTable(ttl_s=60)
    s = table.begin("r", "policy-v1", "req-1")
    status, msg = _status(table.begin, "r", "policy-v1", "req-2")
    assert status == 409 and "already has a call running" in msg
    assert s.busy
    table.end(s)
    assert not s.busy
    assert table.begin("r", "policy-v1", "req-3") is s


def test_version_pin_conflict():
    table = SessionTable(ttl_s=60)
    s = table.begin("r", "policy-v1", "req-1")
    table.end(s)
    status, msg = _status(table.begin, "r", "policy-v2", "req-2")
    assert status == 409 and "pinned to 'policy-v1'" in msg and "'policy-v2'" in msg
    assert not s.busy  # a refused call does not mark the session busy
    assert s.version == "policy-v1"
    assert table.begin("r", "policy-v1", "req-3") is s


def test_version_conflict_while_busy_is_409():
    table = SessionTable(ttl_s=60)
    table.begin("r", "base", "req-1")
    status, _ = _status(table.begin, "r", "policy-v1", "req-2")
    assert status == 409


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "caf\u00e9", "a\nb", "a?b", "a#b", "a\x00"])
def test_bad_session_id_is_400(bad):
    table = SessionTable(ttl_s=60)
    status, msg = _status(table.begin, bad, "base", "req")
    assert status == 400 and "session_id" in msg
    assert table.snapshot() == []


@pytest.mark.parametrize("good", ["a", "x" * 128, "run-3/group.7:rollout@2_x", "A0"])
def test_good_session_ids(good):
    table = SessionTable(ttl_s=60)
    assert table.begin(good, "base", "req").id == good


def test_no_session_id_is_ephemeral_and_not_kept():
    table = SessionTable(ttl_s=60)
    s = table.begin(None, "base", "req-9")
    assert s.ephemeral and s.busy and s.id == "ephemeral-req-9"
    assert table.snapshot() == [] and table.get(s.id) is None
    table.end(s)
    assert table.versions_in_use() == {}


def test_release():
    table = SessionTable(ttl_s=60)
    status, msg = _status(table.release, "nope")
    assert status == 404 and "unknown session" in msg
    s = table.begin("r", "base", "req")
    status, msg = _status(table.release, "r")
    assert status == 409 and "call running" in msg
    assert table.get("r") is s
    table.end(s)
    assert table.release("r") is s
    assert table.get("r") is None
    assert _status(table.release, "r")[0] == 404
    # the id can start a new session, on any version
    assert table.begin("r", "policy-v2", "req").version == "policy-v2"


def test_ttl_expiry(clock):
    table = SessionTable(ttl_s=10)
    a = table.begin("a", "base", "1")
    table.end(a)
    clock.now += 4
    b = table.begin("b", "base", "2")
    table.end(b)
    c = table.begin("c", "base", "3")  # stays busy
    clock.now += 7  # a idle 11 s, b idle 7 s
    assert table.expire() == [a]
    assert table.expired == 1
    assert {s.id for s in table.snapshot()} == {"b", "c"}
    clock.now += 3.5  # b idle 10.5 s; c busy for 10.5 s
    assert table.expire() == [b]
    assert table.expired == 2 and table.get("c") is c
    clock.now += 100
    assert table.expire() == []
    table.end(c)
    assert table.expire() == []  # end refreshed last_used
    clock.now += 10.5
    assert table.expire() == [c]
    assert table.snapshot() == []


def test_use_refreshes_ttl(clock):
    table = SessionTable(ttl_s=10)
    s = table.begin("a", "base", "1")
    table.end(s)
    for _ in range(5):
        clock.now += 8
        assert table.expire() == []
        table.end(table.begin("a", "base", "x"))
    clock.now += 10.01
    assert table.expire() == [s]


def test_versions_in_use():
    table = SessionTable(ttl_s=60)
    for i, v in enumerate(["policy-v1", "policy-v1", "policy-v2", "base"]):
        table.begin(f"s{i}", v, str(i))
    assert table.versions_in_use() == {"policy-v1": 2, "policy-v2": 1, "base": 1}
    table.end(table.get("s0"))
    table.release("s0")
    assert table.versions_in_use() == {"policy-v1": 1, "policy-v2": 1, "base": 1}


def test_concurrent_begin_only_one_wins():
    table = SessionTable(ttl_s=60)
    results = []
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        try:
            table.begin("shared", "base", f"req-{i}")
            results.append("ok")
        except SessionError as exc:
            results.append(exc.status)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [409] * 7 + ["ok"]


def test_session_id_with_trailing_newline_is_400():
    table = SessionTable(ttl_s=60)
    status, _ = _status(table.begin, "abc\n", "base", "req")
    assert status == 400
