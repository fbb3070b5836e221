import json
import sqlite3
import threading

import pytest

from burstrl.store import Group, Rollout, RolloutStore, StoreError, Turn


def make_rollout(rid: str, version: int = 0, reward: float = 1.0, n_turns: int = 2) -> Rollout:
    turns = [Turn(prompt_ids=[1, 2, 3 + t], completion_ids=[4, 5], logprobs=[-0.1234567890123, -1e-9 - t / 3],
                  version=version, replica=f"r{t}") for t in range(n_turns)]
    return Rollout(id=rid, turns=turns, reward=reward, reward_parts={"tests": reward, "format": 0.5},
                   timings={"total_s": 1.25})


def make_group(prefix: str, version: int = 0, size: int = 3) -> list[Rollout]:
    return [make_rollout(f"{prefix}-{i}", version=version, reward=i / 7) for i in range(size)]


@pytest.fixture
def store(tmp_path):
    with RolloutStore(tmp_path / "run" / "store.db") as s:
        yield s


def test_opens_in_wal_mode_with_schema_version(tmp_path):
    path = tmp_path / "new" / "dir" / "store.db"
    RolloutStore(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(1,)]


def test_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "store.db"
    RolloutStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    with pytest.raises(StoreError, match="schema version 99"):
        RolloutStore(path)


def test_round_trip_keeps_ids_order_and_exact_floats(store):
    sent = make_group("a", version=2)
    gid = store.put_group("task-1", sent)
    [got] = store.take(5, trainer_version=2, max_staleness=1)
    assert isinstance(got, Group) and got.id == gid and got.task_id == "task-1" and got.created > 0
    assert got.rollouts == sent  # dataclass equality: ids, turns, logprobs bit for bit, reward, parts
    assert [r.id for r in got.rollouts] == ["a-0", "a-1", "a-2"]
    assert got.rollouts[1].turns[1].logprobs == sent[1].turns[1].logprobs
    assert got.version == 2


def test_put_task_upserts(store):
    store.put_task("t", {"repo": "x"}, difficulty=0.5)
    store.put_task("t", {"repo": "y"}, difficulty=0.9)
    conn = sqlite3.connect(store.path)
    assert conn.execute("SELECT data, difficulty FROM tasks").fetchall() == [(json.dumps({"repo": "y"}), 0.9)]


def test_take_is_oldest_first_and_does_not_consume(store):
    ids = [store.put_group(f"t{i}", make_group(f"g{i}")) for i in range(5)]
    first = store.take(3, trainer_version=0, max_staleness=0)
    assert [g.id for g in first] == ids[:3]
    again = store.take(3, trainer_version=0, max_staleness=0)
    assert [g.id for g in again] == ids[:3]
    assert store.counts()["buffered"] == 5
    store.commit_step(1, ids[:3], {})
    assert [g.id for g in store.take(10, trainer_version=0, max_staleness=0)] == ids[3:]


def test_staleness_bound_marks_stale_and_counts(store):
    old = store.put_group("t", make_group("old", version=1))
    mid = store.put_group("t", make_group("mid", version=3))
    new = store.put_group("t", make_group("new", version=5))
    got = store.take(10, trainer_version=5, max_staleness=2)
    assert [g.id for g in got] == [mid, new]
    assert store.last_take == {"stale": 1, "quarantined": 0}
    info = store.group_info(old)
    assert info["status"] == "stale" and "staleness" in info["reason"]
    c = store.counts()
    assert c["stale"] == 1 and c["buffered"] == 2 and c["buffered_rollouts"] == 6


def test_commit_step_marks_consumed_and_records_the_step(store):
    a = store.put_group("t", make_group("a", version=1))
    b = store.put_group("t", make_group("b", version=3))
    store.put_group("t", make_group("c", version=3))
    assert store.last_step() == 0 and store.step_meta(1) is None
    store.commit_step(1, [a, b], {"trainer_version": 3, "loss": 0.25})
    assert store.last_step() == 1
    assert store.step_meta(1) == {"trainer_version": 3, "loss": 0.25}
    assert store.consumed() == {f"{p}-{i}": 1 for p in "ab" for i in range(3)}
    assert store.group_info(a)["consumed_step"] == 1 and store.group_info(a)["staleness"] == 2
    c = store.counts()
    assert (c["consumed"], c["buffered"], c["buffered_rollouts"]) == (2, 1, 3)
    assert c["staleness_mean"] == 1.0 and c["staleness_max"] == 2
    assert c["rollouts"] == {"complete": 9} and c["steps"] == 1


def test_staleness_defaults_to_step_minus_one(store):
    store.commit_step(1, [], {})
    gid = store.put_group("t", make_group("a", version=0))
    store.commit_step(2, [gid], {})
    assert store.group_info(gid)["staleness"] == 1


def test_refuses_non_consecutive_step_and_double_consumption_writing_nothing(store):
    a = store.put_group("t", make_group("a"))
    b = store.put_group("t", make_group("b"))
    before = store.counts()
    with pytest.raises(StoreError, match="does not follow"):
        store.commit_step(2, [a], {})
    with pytest.raises(StoreError, match="does not follow"):
        store.commit_step(0, [a], {})
    assert store.counts() == before and store.last_step() == 0
    store.commit_step(1, [a], {})
    after_one = store.counts()
    with pytest.raises(StoreError, match=f"group {a} is consumed by step 1"):
        store.commit_step(2, [b, a], {})
    with pytest.raises(StoreError, match="does not exist"):
        store.commit_step(2, [b, 999], {})
    with pytest.raises(StoreError, match="listed twice"):
        store.commit_step(2, [b, b], {})
    assert store.counts() == after_one
    assert store.group_info(b)["status"] == "buffered" and store.step_meta(2) is None


@pytest.mark.parametrize("bad, why", [
    (lambda rs: setattr(rs[1], "reward", float("nan")), "not finite"),
    (lambda rs: rs[0].turns[1].logprobs.append(-0.5), "logprobs"),
    (lambda rs: rs.clear(), "empty group"),
])
def test_invalid_groups_are_quarantined_not_lost(store, bad, why):
    rollouts = make_group("q")
    bad(rollouts)
    gid = store.put_group("t", rollouts)
    info = store.group_info(gid)
    assert info["status"] == "quarantined" and why in info["reason"]
    assert store.take(10, trainer_version=0, max_staleness=0) == []
    assert store.counts()["quarantined"] == 1


def test_duplicate_rollout_id_is_quarantined_without_overwriting(store):
    first = store.put_group("t", make_group("d"))
    dup = make_group("x")
    dup[1] = make_rollout("d-1", reward=-5.0)  # id already stored by the first group
    gid = store.put_group("t", dup)
    info = store.group_info(gid)
    assert info["status"] == "quarantined" and "duplicate rollout id 'd-1'" in info["reason"]
    assert [r["id"] for r in info["raw"]] == ["d-1"] and info["raw"][0]["reward"] == -5.0
    [kept] = store.take(10, trainer_version=0, max_staleness=0)
    assert kept.id == first and kept.rollouts == make_group("d")  # the stored rollout is untouched
    within = store.put_group("t", [make_rollout("w"), make_rollout("w")])
    assert store.group_info(within)["status"] == "quarantined"
    assert store.counts()["rollouts"] == {"complete": 3 + 2 + 1}


@pytest.mark.parametrize("column, value", [
    ("turns", "{not json"),
    ("turns", json.dumps([{"prompt_ids": [1], "completion_ids": [2, 3], "logprobs": [-0.1], "version": 0}])),
    ("reward_parts", "[1, 2"),
])
def test_corrupt_row_is_quarantined_by_take(store, column, value):
    bad = store.put_group("t", make_group("bad"))
    good = store.put_group("t", make_group("good"))
    conn = sqlite3.connect(store.path)
    conn.execute(f"UPDATE rollouts SET {column} = ? WHERE id = 'bad-1'", (value,))
    conn.commit()
    conn.close()
    assert [g.id for g in store.take(10, trainer_version=0, max_staleness=0)] == [good]
    assert store.last_take == {"stale": 0, "quarantined": 1}
    info = store.group_info(bad)
    assert info["status"] == "quarantined" and "corrupt row: rollout bad-1" in info["reason"]
    assert store.counts()["quarantined"] == 1


def test_take_fills_up_past_stale_and_corrupt_groups(store):
    store.put_group("t", make_group("s", version=0))
    bad = store.put_group("t", make_group("bad", version=4))
    sqlite3.connect(store.path, isolation_level=None).execute("UPDATE rollouts SET turns = 'x' WHERE group_id = ?",
                                                              (bad,))
    ok = [store.put_group("t", make_group(f"ok{i}", version=4)) for i in range(3)]
    assert [g.id for g in store.take(2, trainer_version=4, max_staleness=1)] == ok[:2]
    assert store.last_take == {"stale": 1, "quarantined": 1}


def test_persists_across_reopen(tmp_path):
    path = tmp_path / "store.db"
    with RolloutStore(path) as s:
        a = s.put_group("t", make_group("a"))
        b = s.put_group("t", make_group("b"))
        s.commit_step(1, [a], {"trainer_version": 0})
    with RolloutStore(path) as s:
        assert s.last_step() == 1 and s.step_meta(1) == {"trainer_version": 0}
        assert [g.id for g in s.take(5, trainer_version=0, max_staleness=0)] == [b]
        assert set(s.consumed()) == {"a-0", "a-1", "a-2"}


def test_passed_and_calls_are_typed_columns(store):
    sent = make_group("p")
    sent[1].passed, sent[1].calls = True, 4
    store.put_group("t", sent)
    [got] = store.take(1, trainer_version=0, max_staleness=1)
    assert [(r.passed, r.calls) for r in got.rollouts] == [(False, 0), (True, 4), (False, 0)]
    assert got.rollouts[1].timings == {"total_s": 1.25}
    conn = sqlite3.connect(store.path)
    assert conn.execute("SELECT passed, calls FROM rollouts WHERE id = 'p-1'").fetchone() == (1, 4)


def test_a_store_from_before_the_outcome_columns_gets_them_and_reads_timings(tmp_path):
    """Rows written when `passed` and `calls` were keys of the timings JSON keep their values."""
    path = tmp_path / "old.db"
    with RolloutStore(path) as s:
        s.put_group("t", make_group("o", size=2))
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE rollouts DROP COLUMN passed")
    conn.execute("ALTER TABLE rollouts DROP COLUMN calls")
    conn.execute("""UPDATE rollouts SET timings = '{"total_s": 1.25, "calls": 3, "passed": 1.0}' WHERE id = 'o-0'""")
    conn.commit()
    conn.close()
    with RolloutStore(path) as s:
        s.put_group("t", make_group("n", size=2))
        old, new = s.take(2, trainer_version=0, max_staleness=1)
    assert [(r.passed, r.calls, r.timings) for r in old.rollouts] == [(True, 3, {"total_s": 1.25}),
                                                                     (False, 0, {"total_s": 1.25})]
    assert [(r.passed, r.calls) for r in new.rollouts] == [(False, 0), (False, 0)]
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT passed, calls FROM rollouts WHERE id = 'o-0'").fetchone() == (None, None)


def test_groups_lists_buffered_consumed_and_stale_groups_without_changing_them(store):
    a = store.put_group("ta", make_group("a"))
    b = store.put_group("tb", make_group("b", version=2))
    old = store.put_group("to", make_group("o", version=0))
    store.put_group("bad", [])  # quarantined: not listed
    store.commit_step(1, [a], {"trainer_version": 0})
    store.take(5, trainer_version=3, max_staleness=2)  # only `old` (version 0) is too stale
    got = store.groups()
    assert [(g.id, g.task_id) for g in got] == [(a, "ta"), (b, "tb"), (old, "to")]
    assert got[1].rollouts == make_group("b", version=2)
    assert [g.id for g in store.groups(["buffered"])] == [b]
    assert store.counts()["buffered"] == 1 and store.counts()["stale"] == 1


def test_wait_for_returns_count_on_data_or_timeout(store):
    assert store.wait_for(1, timeout_s=0.05, poll_s=0.01) == 0
    threading.Timer(0.05, lambda: store.put_group("t", make_group("late"))).start()
    assert store.wait_for(1, timeout_s=5.0, poll_s=0.01) == 1


def test_usable_from_several_threads(store):
    def put(k: int) -> None:
        for i in range(10):
            store.put_group("t", make_group(f"th{k}-{i}", size=2))

    threads = [threading.Thread(target=put, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.counts()["buffered"] == 40 and store.counts()["buffered_rollouts"] == 80
