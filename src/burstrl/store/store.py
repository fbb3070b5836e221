"""The rollout store: one SQLite file in WAL mode, shared by the orchestrator and trainer rank 0.

The orchestrator appends finished groups (`put_group`); the trainer reads the oldest buffered groups
(`take`) and, once its step is checkpointed, marks them consumed (`commit_step`). Those are separate
processes, so every write is one SQLite transaction and nothing lives only in memory: a crash of
either side loses at most the transaction in flight, never half a group, and a group is consumed by
at most one step.

Durability: `synchronous=FULL` makes SQLite fsync the WAL at every commit, so a committed step or
group survives power loss, not just a process crash. (`NORMAL` would only risk the last commits on
power loss; the write rate here, one group or one step at a time, is far too low for the saving to
matter.) Writes that read before they write (`take`, `commit_step`, the duplicate check of
`put_group`) start with `BEGIN IMMEDIATE`, so two writers queue on the busy timeout instead of
failing with "database is locked" when they upgrade a read lock.

Quarantine: a group that must not be trained on (empty, an invalid rollout, a rollout id already
used, or a row that no longer decodes) keeps status `quarantined` and a reason; it is counted and
can be inspected but is never returned by `take`. Its rollouts are stored as rows when their id is
new; a rollout whose id is already taken is never written over the existing row: its JSON goes to
the group's `raw` column instead.

Schema: the tables, and the columns added to them since schema version 1 shipped, are in
`schema.py`; opening an older file adds those columns in place.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from burstrl.store.schema import ADDED_COLUMNS, GROUP_STATUSES, SCHEMA, SCHEMA_VERSION
from burstrl.store.types import Group, Rollout


class StoreError(RuntimeError):
    """A store operation that was refused (nothing was written); the message says why."""


def _json_default(obj: Any) -> Any:
    """Numpy/torch scalars become plain numbers; anything else is not storable as JSON."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=_json_default)


def _raw_dumps(obj: Any) -> str:
    """Best-effort JSON for quarantined data: keep whatever can be kept, as text if need be."""
    return json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else repr(o))


def _check_rollout(r: Rollout) -> str | None:
    """Why this rollout must not be trained on, or None if it is fine."""
    try:
        r.validate()
    except (TypeError, ValueError, AttributeError) as e:  # BadRollout is a ValueError
        return f"rollout {getattr(r, 'id', '?')}: {e}"
    return None


def _safe_version(r: Rollout) -> int | None:
    try:
        return int(r.version)
    except (TypeError, ValueError, AttributeError):
        return None


def _float_or_none(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _encode(r: Rollout) -> tuple[str, str, str, int, int] | None:
    """(turns, reward_parts, timings as JSON, passed, calls), or None if the rollout cannot be
    stored faithfully."""
    try:
        return (_dumps(r.to_json()["turns"]), _dumps(r.reward_parts), _dumps(r.timings), int(bool(r.passed)),
                int(r.calls))
    except (TypeError, ValueError):
        return None


class RolloutStore:
    """A handle on the store file: one connection, usable from a few threads (calls are serialised)."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so each method is exactly one transaction.
        self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None,
                                     check_same_thread=False)
        self.last_take: dict[str, int] = {"stale": 0, "quarantined": 0}  # what the last `take` set aside
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            self._set_wal(busy_timeout_s)
            self._conn.execute("PRAGMA synchronous = FULL")
            self._init_schema()
        except BaseException:
            self._conn.close()
            raise

    def _set_wal(self, timeout_s: float) -> None:
        """Switch to WAL; the switch needs an exclusive lock, so retry while another process opens the file."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if mode.lower() != "wal":
            raise StoreError(f"{self.path}: could not switch SQLite to WAL mode (got {mode!r})")

    def _init_schema(self) -> None:
        with self._tx():
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    self._conn.execute(stmt)
            row = self._conn.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                self._conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif row[0] != SCHEMA_VERSION:
                raise StoreError(f"{self.path}: schema version {row[0]}, this burstrl reads {SCHEMA_VERSION}")
            for table, name, kind in ADDED_COLUMNS:  # a file made before they were added gets them now
                columns = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
                if name not in columns:
                    self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    @contextmanager
    def _tx(self, immediate: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction: committed if the block returns, rolled back if it raises."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> RolloutStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writes from the orchestrator ----

    def put_task(self, task_id: str, data: dict, difficulty: float = 0.0) -> None:
        """Insert or replace a task's data and difficulty (its creation time is kept)."""
        text = _dumps(data)
        with self._tx() as c:
            c.execute("INSERT INTO tasks (id, data, difficulty, created) VALUES (?, ?, ?, ?) "
                      "ON CONFLICT(id) DO UPDATE SET data = excluded.data, difficulty = excluded.difficulty",
                      (task_id, text, float(difficulty), time.time()))

    def put_group(self, task_id: str, rollouts: list[Rollout]) -> int:
        """Store a finished group and its rollouts in one transaction; returns the group id.

        A group that must not be trained on is still stored, as `quarantined` with the reason, so that
        it is counted and can be inspected.
        """
        reason = "empty group" if not rollouts else None
        encoded = []
        for r in rollouts:
            reason = reason or _check_rollout(r)
            enc = _encode(r)
            if enc is None:
                reason = reason or f"rollout {r.id}: not JSON serialisable"
            encoded.append(enc)
        now = time.time()
        with self._tx() as c:
            ids = [r.id for r in rollouts]
            taken = self._existing_ids(c, ids)
            seen: set[str] = set()
            keep: list[bool] = []
            for rid in ids:
                keep.append(rid not in taken and rid not in seen)
                seen.add(rid)
            if not all(keep):
                dup = next(rid for rid, k in zip(ids, keep, strict=False) if not k)
                reason = reason or f"duplicate rollout id {dup!r}"
            status = "quarantined" if reason else "buffered"
            versions = [_safe_version(r) for r in rollouts]
            version = min(versions) if versions and None not in versions else None
            raw = [r.to_json() for r, k, enc in zip(rollouts, keep, encoded, strict=False) if not k or enc is None]
            cur = c.execute("INSERT INTO groups (task_id, version, status, reason, raw, created) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            (task_id, version, status, reason, _raw_dumps(raw) if raw else None, now))
            gid = int(cur.lastrowid)
            c.executemany("UPDATE attempts SET status = 'stored', finished = ? WHERE id = ? AND status = 'running'",
                          [(now, rid) for rid, k in zip(ids, keep, strict=False) if k])
            for idx, (r, k, enc, v) in enumerate(zip(rollouts, keep, encoded, versions, strict=False)):
                if k and enc is not None:
                    reward = _float_or_none(r.reward)
                    reason = getattr(r, "reason", None)
                    c.execute("INSERT INTO rollouts (id, group_id, idx, status, reward, reward_parts, turns, "
                              "timings, version, created, reason, passed, calls) "
                              "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                              (r.id, gid, idx, r.status, reward, enc[1], enc[0], enc[2], v, now,
                               str(reason) if reason else None, enc[3], enc[4]))
        return gid

    @staticmethod
    def _existing_ids(c: sqlite3.Connection, ids: list[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(ids), 500):  # stay under SQLite's bound-parameter limit
            chunk = ids[i:i + 500]
            marks = ",".join("?" * len(chunk))
            found.update(row[0] for row in c.execute(f"SELECT id FROM rollouts WHERE id IN ({marks})", chunk))
        return found

    def start_attempt(self, rollout_id: str, task_id: str) -> None:
        """Record that an attempt started (StoreError if its id was ever used: ids are never reused)."""
        try:
            with self._tx() as c:
                c.execute("INSERT INTO attempts (id, task_id, status, started) VALUES (?, ?, 'running', ?)",
                          (rollout_id, task_id, time.time()))
        except sqlite3.IntegrityError:
            raise StoreError(f"attempt id {rollout_id!r} was already used") from None

    def end_attempt(self, rollout_id: str, status: str, detail: str = "") -> None:
        """Close a running attempt as `requeued` or `abandoned` (stored attempts close in `put_group`)."""
        if status not in ("requeued", "abandoned"):
            raise StoreError(f"an attempt ends requeued or abandoned here, not {status!r}")
        with self._tx() as c:
            c.execute("UPDATE attempts SET status = ?, detail = ?, finished = ? WHERE id = ? AND status = 'running'",
                      (status, detail, time.time(), rollout_id))

    def abandon_running_attempts(self, detail: str) -> int:
        """Attempts left `running` by a process that stopped or crashed: closed, counted, never silently lost."""
        with self._tx() as c:
            return c.execute("UPDATE attempts SET status = 'abandoned', detail = ?, finished = ? "
                             "WHERE status = 'running'", (detail, time.time())).rowcount

    def attempts(self) -> dict[str, tuple[str, str]]:
        """Attempt id -> (status, detail), for audits: every id ends in exactly one status."""
        with self._lock:
            rows = self._conn.execute("SELECT id, status, COALESCE(detail, '') FROM attempts").fetchall()
        return {rid: (status, detail) for rid, status, detail in rows}

    def audit(self) -> dict[str, Any]:
        """Nothing lost, nothing twice, by rollout id: the figures a fault test or benchmark checks.

        `lost` counts attempts still `running` plus rollout rows whose attempt is not `stored` plus
        `stored` attempts without a row; `consumed_twice` counts groups listed by two steps.
        """
        with self._tx(immediate=False) as c:
            statuses = dict(c.execute("SELECT status, COUNT(*) FROM attempts GROUP BY status").fetchall())
            orphan_rows = c.execute("SELECT COUNT(*) FROM rollouts r LEFT JOIN attempts a ON a.id = r.id "
                                    "WHERE a.status IS NOT 'stored'").fetchone()[0]
            empty_stored = c.execute("SELECT COUNT(*) FROM attempts a LEFT JOIN rollouts r ON a.id = r.id "
                                     "WHERE a.status = 'stored' AND r.id IS NULL").fetchone()[0]
            listed = [g for (text,) in c.execute("SELECT groups FROM steps") for g in json.loads(text)]
        return {"attempts": statuses, "lost": statuses.get("running", 0) + orphan_rows + empty_stored,
                "consumed_twice": len(listed) - len(set(listed))}

    # ---- reads and commits from the trainer ----

    def take(self, n_groups: int, trainer_version: int, max_staleness: int) -> list[Group]:
        """The oldest buffered groups, at most `n_groups`; they stay buffered until `commit_step`.

        Groups too stale for `trainer_version` are marked `stale`, rows that no longer decode are
        marked `quarantined`, both in this same transaction (see `last_take` for how many).
        """
        out: list[Group] = []
        stats = {"stale": 0, "quarantined": 0}
        with self._tx() as c:
            cur = c.execute("UPDATE groups SET status = 'stale', reason = ? "
                            "WHERE status = 'buffered' AND ? - version > ?",
                            (f"staleness above {max_staleness} at trainer version {trainer_version}",
                             trainer_version, max_staleness))
            stats["stale"] = cur.rowcount
            last_id = 0
            while len(out) < n_groups:
                rows = c.execute("SELECT id, task_id, created FROM groups WHERE status = 'buffered' AND id > ? "
                                 "ORDER BY id LIMIT ?", (last_id, n_groups - len(out))).fetchall()
                if not rows:
                    break
                for gid, task_id, created in rows:
                    last_id = gid
                    rollouts, why = self._decode_group(c, gid)
                    if why is not None:
                        c.execute("UPDATE groups SET status = 'quarantined', reason = ? WHERE id = ?", (why, gid))
                        stats["quarantined"] += 1
                    else:
                        out.append(Group(id=gid, task_id=task_id, rollouts=rollouts, created=created))
        self.last_take = stats
        return out

    @staticmethod
    def _decode_group(c: sqlite3.Connection, gid: int) -> tuple[list[Rollout], str | None]:
        """The group's rollouts in stored order, or the reason they cannot be trained on."""
        rows = c.execute("SELECT id, status, reward, reward_parts, turns, timings, reason, passed, calls "
                         "FROM rollouts WHERE group_id = ? ORDER BY idx", (gid,)).fetchall()
        if not rows:
            return [], "corrupt row: group has no rollouts"
        rollouts = []
        for rid, status, reward, parts, turns, timings, reason, passed, calls in rows:
            # NULL outcome columns: a row written before they existed keeps them in `timings`
            outcome = {} if passed is None else {"passed": bool(passed), "calls": calls}
            try:
                r = Rollout.from_json({"id": rid, "status": status, "reward": reward, "turns": json.loads(turns),
                                       "reward_parts": json.loads(parts), "timings": json.loads(timings),
                                       "reason": reason, **outcome})
                r.validate()
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                return [], f"corrupt row: rollout {rid}: {type(e).__name__}: {e}"
            rollouts.append(r)
        return rollouts, None

    def commit_step(self, step: int, group_ids: list[int], meta: dict) -> None:
        """Mark the groups trained by `step` consumed and record the step, all or nothing.

        Refused (StoreError, nothing written) unless `step` follows the last committed step and every
        group is still buffered: a rollout must never be trained twice.
        """
        meta_text = _dumps(meta)
        trainer_version = int(meta.get("trainer_version", step - 1))
        now = time.time()
        with self._tx() as c:
            last = self._last_step(c)
            if step != last + 1:
                raise StoreError(f"step {step} does not follow the last committed step {last}")
            if len(set(group_ids)) != len(group_ids):
                raise StoreError(f"step {step}: a group id is listed twice in {group_ids}")
            for gid in group_ids:
                row = c.execute("SELECT status, consumed_step FROM groups WHERE id = ?", (gid,)).fetchone()
                if row is None:
                    raise StoreError(f"step {step}: group {gid} does not exist")
                if row[0] != "buffered":
                    was = f" by step {row[1]}" if row[0] == "consumed" else ""
                    raise StoreError(f"step {step}: group {gid} is {row[0]}{was}, not buffered")
            for gid in group_ids:
                c.execute("UPDATE groups SET status = 'consumed', consumed_step = ?, staleness = ? - version "
                          "WHERE id = ?", (step, trainer_version, gid))
            c.execute("INSERT INTO steps (step, committed_at, groups, meta) VALUES (?, ?, ?, ?)",
                      (step, now, json.dumps(list(group_ids)), meta_text))

    @staticmethod
    def _last_step(c: sqlite3.Connection) -> int:
        return int(c.execute("SELECT COALESCE(MAX(step), 0) FROM steps").fetchone()[0])

    def last_step(self) -> int:
        """The last committed step (0 before the first)."""
        with self._lock:
            return self._last_step(self._conn)

    def step_meta(self, step: int) -> dict | None:
        with self._lock:
            row = self._conn.execute("SELECT meta FROM steps WHERE step = ?", (step,)).fetchone()
        return None if row is None else json.loads(row[0])

    # ---- inspection ----

    def counts(self) -> dict[str, Any]:
        """Groups by status, rollouts by their own status, buffered rollouts, staleness of consumed groups.

        Read in one snapshot, so the figures agree with each other even while a writer is active.
        Staleness figures are 0 before anything was consumed.
        """
        with self._tx(immediate=False) as c:
            out: dict[str, Any] = dict.fromkeys(GROUP_STATUSES, 0)
            out.update(dict(c.execute("SELECT status, COUNT(*) FROM groups GROUP BY status").fetchall()))
            out["rollouts"] = dict(c.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status").fetchall())
            out["buffered_rollouts"] = c.execute(
                "SELECT COUNT(*) FROM rollouts r JOIN groups g ON r.group_id = g.id "
                "WHERE g.status = 'buffered'").fetchone()[0]
            mean, mx = c.execute("SELECT AVG(staleness), MAX(staleness) FROM groups "
                                 "WHERE status = 'consumed'").fetchone()
            out["staleness_mean"] = float(mean) if mean is not None else 0.0
            out["staleness_max"] = int(mx) if mx is not None else 0
            out["steps"] = self._last_step(c)
            out["attempts"] = dict(c.execute("SELECT status, COUNT(*) FROM attempts GROUP BY status").fetchall())
        return out

    def failure_reasons(self, limit: int = 20) -> dict[str, Any]:
        """Failed rollouts by reason kind (the text before the first ':') and the latest reasons
        verbatim: where a user looks when rewards drop or a policy starts gaming the grader."""
        with self._tx(immediate=False) as c:
            kinds = dict(c.execute("SELECT CASE WHEN instr(reason, ':') > 0 "
                                   "THEN substr(reason, 1, instr(reason, ':') - 1) ELSE reason END AS kind, "
                                   "COUNT(*) FROM rollouts WHERE reason IS NOT NULL GROUP BY kind ORDER BY kind"
                                   ).fetchall())
            latest = c.execute("SELECT r.id, g.task_id, r.reason FROM rollouts r JOIN groups g ON r.group_id = g.id "
                               "WHERE r.reason IS NOT NULL ORDER BY r.created DESC, r.rowid DESC LIMIT ?",
                               (limit,)).fetchall()
        return {"kinds": kinds, "latest": [{"rollout": rid, "task_id": tid, "reason": reason}
                                           for rid, tid, reason in latest]}

    def consumed(self) -> dict[str, int]:
        """Rollout id -> the step that consumed it."""
        with self._lock:
            rows = self._conn.execute("SELECT r.id, g.consumed_step FROM rollouts r JOIN groups g "
                                      "ON r.group_id = g.id WHERE g.status = 'consumed'").fetchall()
        return dict(rows)

    def group_info(self, group_id: int) -> dict[str, Any] | None:
        """A group's row (status, reason, version, consumed_step, staleness, raw), for inspection and tests."""
        with self._lock:
            cur = self._conn.execute("SELECT id, task_id, version, status, reason, consumed_step, staleness, raw, "
                                     "created FROM groups WHERE id = ?", (group_id,))
            row = cur.fetchone()
            if row is None:
                return None
            info = dict(zip([d[0] for d in cur.description], row, strict=False))
        info["raw"] = json.loads(info["raw"]) if info["raw"] else None
        return info

    def groups(self, statuses: Sequence[str] = ("buffered", "consumed", "stale")) -> list[Group]:
        """The groups in `statuses` with their rollouts, oldest first, changing nothing: for
        inspection and tests, which then need no SQL. A row that no longer decodes is a StoreError
        naming it (`take` would quarantine its group; quarantined groups are not listed by default)."""
        marks = ",".join("?" * len(statuses))
        out: list[Group] = []
        with self._tx(immediate=False) as c:
            rows = c.execute(f"SELECT id, task_id, created FROM groups WHERE status IN ({marks}) ORDER BY id",
                             tuple(statuses)).fetchall()
            for gid, task_id, created in rows:
                rollouts, why = self._decode_group(c, gid)
                if why is not None:
                    raise StoreError(f"group {gid}: {why}")
                out.append(Group(id=gid, task_id=task_id, rollouts=rollouts, created=created))
        return out

    def buffered_count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM groups WHERE status = 'buffered'").fetchone()[0])

    def wait_for(self, n_groups: int, timeout_s: float, poll_s: float = 0.05) -> int:
        """Poll until at least `n_groups` are buffered or `timeout_s` passes; returns the buffered count."""
        deadline = time.monotonic() + timeout_s
        while True:
            n = self.buffered_count()
            if n >= n_groups or time.monotonic() >= deadline:
                return n
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
