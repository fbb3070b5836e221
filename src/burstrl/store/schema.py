"""The rollout store's tables, and the columns added to them since schema version 1 shipped.

Failure reasons: a rollout's `reason` column holds the text of why a failed attempt failed
(`sandbox_lost: ...`, `tampered: ...`, `tests_timeout: ...`), queryable with plain SQL
(`SELECT reason, COUNT(*) FROM rollouts GROUP BY ...`) or `failure_reasons()`. The column was added
after schema version 1 shipped (`ADDED_COLUMNS`).

Outcome columns: `passed` (0/1) and `calls` are a rollout's own columns, not keys inside the
`timings` JSON, so they are typed on both sides and queryable (`SELECT AVG(passed) ...`). They were
added the same way as `reason`: an older file gets them in place with NULL in its old rows, and
those rows still carry the values in `timings`, where `Rollout.from_json` finds them.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
GROUP_STATUSES = ("buffered", "consumed", "stale", "quarantined")
# An attempt (one rollout id) is `running` until it ends `stored` (in a group, same transaction as the
# group), `requeued` (a replica failed; another attempt with a new id replaces it) or `abandoned`
# (its group was given up, or the orchestrator stopped or crashed while it ran).
ATTEMPT_STATUSES = ("running", "stored", "requeued", "abandoned")

SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    difficulty REAL NOT NULL DEFAULT 0.0,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL,
    version INTEGER,
    status TEXT NOT NULL,
    reason TEXT,
    consumed_step INTEGER,
    staleness INTEGER,
    raw TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS groups_status ON groups (status, id);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    group_id INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    status TEXT,
    reward REAL,
    reward_parts TEXT,
    turns TEXT,
    timings TEXT,
    version INTEGER,
    created REAL NOT NULL,
    reason TEXT,
    passed INTEGER,
    calls INTEGER
);
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts (group_id, idx);
CREATE TABLE IF NOT EXISTS attempts (
    id TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    status TEXT NOT NULL,
    detail TEXT,
    started REAL NOT NULL,
    finished REAL
);
CREATE INDEX IF NOT EXISTS attempts_status ON attempts (status);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    committed_at REAL NOT NULL,
    groups TEXT NOT NULL,
    meta TEXT NOT NULL
);
"""

# Columns added after schema version 1 shipped, in the order added: nullable, so an older file gets
# them in place (`ALTER TABLE ... ADD COLUMN`, old rows NULL), with no version bump and no copy.
ADDED_COLUMNS = (("rollouts", "reason", "TEXT"), ("rollouts", "passed", "INTEGER"), ("rollouts", "calls", "INTEGER"))
