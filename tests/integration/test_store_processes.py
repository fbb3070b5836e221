"""The store shared by real processes: a writer and a reader/committer, and a writer killed mid-transaction."""

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

from burstrl.store import Rollout, RolloutStore, Turn

GROUP_SIZE = 4

WRITER = textwrap.dedent("""
    import sys
    from burstrl.store import Rollout, RolloutStore, Turn

    path, n_groups, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with RolloutStore(path) as store:
        for g in range(n_groups):
            rollouts = [Rollout(id=f"{tag}-{g}-{i}", reward=float(i),
                                turns=[Turn([1, 2, 3], [4, 5], [-0.5, -0.25], version=0)])
                        for i in range(4)]
            store.put_group(f"task-{g % 7}", rollouts)
    print("done", flush=True)
""")

# Opens the store, starts a write transaction, writes half a group, says so, then waits to be killed.
HALF_WRITER = textwrap.dedent("""
    import sys, time
    from burstrl.store import RolloutStore

    store = RolloutStore(sys.argv[1])
    c = store._conn
    c.execute("BEGIN IMMEDIATE")
    gid = c.execute("INSERT INTO groups (task_id, version, status, created) VALUES ('half', 0, 'buffered', 0)").lastrowid
    c.execute("INSERT INTO rollouts (id, group_id, idx, status, reward, reward_parts, turns, timings, version, created)"
              " VALUES ('half-0', ?, 0, 'complete', 1.0, '{}', '[]', '{}', 0, 0)", (gid,))
    print("inside", flush=True)
    time.sleep(60)
""")


def spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def group(tag: str) -> list[Rollout]:
    return [Rollout(id=f"{tag}-{i}", reward=float(i), turns=[Turn([1, 2], [3], [-0.5], version=0)])
            for i in range(GROUP_SIZE)]


def test_concurrent_writer_and_committer_lose_nothing_and_train_nothing_twice(tmp_path):
    path = tmp_path / "store.db"
    n_groups = 200
    writer = spawn(WRITER, path, n_groups, "w")
    trained: list[int] = []
    step = 0
    with RolloutStore(path) as store:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            writer_done = writer.poll() is not None
            groups = store.take(8, trainer_version=step, max_staleness=1000)
            if groups:
                for g in groups:
                    assert len(g.rollouts) == GROUP_SIZE
                step += 1
                store.commit_step(step, [g.id for g in groups], {"trainer_version": step - 1})
                trained.extend(g.id for g in groups)
            elif writer_done:
                break
            else:
                store.wait_for(1, timeout_s=0.5, poll_s=0.005)
        out, err = writer.communicate(timeout=30)
        assert writer.returncode == 0, err
        assert "locked" not in err and out.strip() == "done"
        counts = store.counts()
        consumed = store.consumed()
    assert len(trained) == len(set(trained))  # no group taken into two steps
    assert counts["consumed"] == len(trained) and counts["consumed"] + counts["buffered"] == n_groups
    assert counts["stale"] == counts["quarantined"] == 0 and counts["steps"] == step
    assert len(consumed) == GROUP_SIZE * len(trained)
    assert set(consumed) == {f"w-{g}-{i}" for g in range(n_groups) for i in range(GROUP_SIZE)}


def test_writer_killed_inside_a_transaction_leaves_store_consistent(tmp_path):
    path = tmp_path / "store.db"
    with RolloutStore(path) as store:
        before = store.put_group("t", group("before"))
        child = spawn(HALF_WRITER, path)
        try:
            assert child.stdout.readline().strip() == "inside", child.stderr.read()
            # WAL: readers are not blocked by the open write transaction, and do not see it.
            assert store.counts()["buffered"] == 1
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
        finally:
            if child.poll() is None:
                child.kill()
            child.communicate()
        assert child.returncode == -signal.SIGKILL
        after = store.put_group("t", group("after"))  # the lock died with the process
        assert [g.id for g in store.take(10, trainer_version=0, max_staleness=0)] == [before, after]
        store.commit_step(1, [before, after], {})
        assert store.counts()["consumed"] == 2 and "half-0" not in store.consumed()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT COUNT(*) FROM groups WHERE task_id = 'half'").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM rollouts WHERE id LIKE 'half%'").fetchone()[0] == 0


def test_writer_killed_at_a_random_point_leaves_only_whole_groups(tmp_path):
    path = tmp_path / "store.db"
    writer = spawn(WRITER, path, 100_000, "k")
    with RolloutStore(path) as store:
        assert store.wait_for(20, timeout_s=30, poll_s=0.01) >= 20
        writer.send_signal(signal.SIGKILL)
        writer.communicate(timeout=10)
        groups = store.take(100_000, trainer_version=0, max_staleness=0)
        assert groups and store.last_take == {"stale": 0, "quarantined": 0}
        assert all(len(g.rollouts) == GROUP_SIZE for g in groups)
        n_rollouts = sum(store.counts()["rollouts"].values())
        assert n_rollouts == GROUP_SIZE * len(groups)
        store.commit_step(1, [g.id for g in groups], {})
        assert store.put_group("t", group("after")) > groups[-1].id
