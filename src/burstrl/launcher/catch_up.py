"""Catch-up pushes: a shared fleet's replica that joins late serves this run's newest version at once (issue 51).

Why: in a run that owns its fleet, a replica that joins late (a replacement, a scale-up) loads the
newest verified version from the run's volume as it starts (`inference.replica._load_newest_version`).
A replica of a shared fleet cannot read any tenant's run directory, so until the tenant's next push it
served none of the tenant's versions: the router sends the tenant's new sessions only to replicas
that serve its newest version, and after losing replicas mid-step the fleet ran short for that tenant
for a whole step.

Why the tenant's launcher: it holds the volume and the token that names the run's versions on the
fleet, and it already asks the fleet for its replicas every few seconds (`tenant_run.py`). A URL new to
that list gets what a late joiner loads from a volume: the newest version that verifies (only that
one), as the trainer pushes it (`trainer.publish.serving_files` in the serving dtype, one shard per
trainer rank, so a push racing the trainer's own stages the same bytes), through `weights.push`.

Why only URLs new to the list: the replicas already listed get every version from the trainer's own
push. No version is missed in between: the launcher writes the replicas file before it looks at the
volume here, and the trainer reads that file after it has written a version to the volume, so a
version published after this look reaches the new URL through the trainer. A URL that leaves the
list and comes back is new again.

Faults: a push that fails on a replica is counted and tried again at the next poll, up to MAX_TRIES
times (then left to the trainer's next push: a `catch_up_given_up` event, and the run's fleet.jsonl
samples count it as `catch_up_given_up`, so a replica that never got the newest version shows there,
not only as a run of `catch_up_failed` tries); never raised, so one bad replica never stops the run.
The pushes run in one background thread owned by `CatchUp`, joined by `close` (before the run
releases its versions, so none lands after); the launcher logs results from its own loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from burstrl.protocol.versions import version_name

MAX_TRIES = 3  # pushes of one URL that may fail before it is left to the trainer's next push
RETRY_S = 2.0  # a failed URL is tried again after this long (a replica just listed may still be settling)
PUSH_TIMEOUT_S = 60.0


@dataclass
class PushOutcome:
    """One URL's catch-up: the version sent (None: the volume has none yet), and how it went."""

    url: str
    version: int | None
    ok: bool
    already: bool = False  # it served the version before (the trainer's push got there first)
    seconds: float = 0.0
    reason: str = ""


class CatchUp:
    """Pushes the run's newest version to fleet replicas it has not seen before.

    `poll(urls)` with the fleet's current list (after writing it to the replicas file): it notes new
    URLs, takes in the last finished batch of pushes and starts the next in the background.
    `log(event, detail)` is the launcher's event writer, called only from `poll` and `close`.
    """

    def __init__(self, volume: Path, token: str, verify: bool | str, log: Callable[[str, str], None],
                 senders: int = 1, dtype: str = "float32", retries: int = 1, retry_s: float = RETRY_S) -> None:
        self.volume, self.token, self.verify, self.log = Path(volume), token, verify, log
        self.senders, self.dtype, self.retries, self.retry_s = senders, dtype, retries, retry_s
        self.listed: set[str] = set()  # the fleet's last list
        self.pending: dict[str, int] = {}  # URL -> failed tries so far
        self.not_before: dict[str, float] = {}  # URL -> when (monotonic) a failed one is tried again
        self.pushes = 0  # versions sent to a replica that lacked them
        self.failures = 0  # pushes that failed (each try)
        self.given_up = 0  # URLs left to the trainer's next push after MAX_TRIES failed pushes
        self.thread: threading.Thread | None = None
        self.finished: list[PushOutcome] = []

    def poll(self, urls: list[str]) -> None:
        """Note the fleet's list; start pushing to its new URLs unless a batch is still running."""
        now = {u.rstrip("/") for u in urls}  # as `read_targets` names them in a push's report
        for url in self.listed - now:  # left the fleet: if it comes back, it is new again
            self.pending.pop(url, None)
        for url in now - self.listed:
            self.pending.setdefault(url, 0)
        self.listed = now
        if self.thread is not None:
            if self.thread.is_alive():
                return
            self.thread = None
            self.take(self.finished)
        batch = sorted(u for u in self.pending if self.not_before.get(u, 0.0) <= time.monotonic())
        if batch:
            self.finished = []
            self.thread = threading.Thread(target=self.run, args=(batch,), name="catch-up-push", daemon=True)
            self.thread.start()

    def close(self, timeout_s: float = PUSH_TIMEOUT_S) -> None:
        """Wait for a batch in flight (none may land after the run releases its versions) and log it."""
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)
            if not self.thread.is_alive():
                self.take(self.finished)
            self.thread = None
        self.pending.clear()

    def counts(self) -> dict[str, int]:
        """The figures the launcher adds to each fleet.jsonl sample."""
        return {"catch_up_pushes": self.pushes, "catch_up_failures": self.failures,
                "catch_up_given_up": self.given_up}

    def take(self, outcomes: list[PushOutcome]) -> None:
        """Count and log a finished batch; a URL that failed stays pending until MAX_TRIES."""
        for out in outcomes:
            if out.url not in self.pending:  # left the list meanwhile
                continue
            if out.ok:
                del self.pending[out.url]
                if out.version is not None and not out.already:
                    self.pushes += 1
                    self.log("catch_up_push", f"{version_name(out.version)} to {out.url} in {out.seconds:.2f} s")
                continue
            self.failures += 1
            self.pending[out.url] += 1
            self.not_before[out.url] = time.monotonic() + self.retry_s
            tries = self.pending[out.url]
            self.log("catch_up_failed", f"{out.url} (try {tries} of {MAX_TRIES}): {out.reason}")
            if tries >= MAX_TRIES:
                del self.pending[out.url]
                self.given_up += 1
                self.log("catch_up_given_up", f"{out.url} after {tries} failed pushes: "
                         "it gets the run's versions from the trainer's next push")

    def run(self, urls: list[str]) -> None:
        """The background batch: the newest version to every URL (in parallel), outcomes to `finished`."""
        try:
            self.finished = self.push_newest(urls)
        except Exception as exc:  # noqa: BLE001 - a catch-up is best effort: a broken volume read is a failure
            reason = f"{type(exc).__name__}: {exc}"
            self.finished = [PushOutcome(url, None, ok=False, reason=reason) for url in urls]

    def push_newest(self, urls: list[str]) -> list[PushOutcome]:
        from burstrl.weights.push import push, read_targets
        from burstrl.weights.volume import latest

        found = latest(self.volume)
        if found is None:  # no version yet: the trainer's first push reaches every listed URL
            return [PushOutcome(url, None, ok=True) for url in urls]
        version, path = found
        files = None
        if self.dtype != "float32":
            from burstrl.trainer.publish import serving_files

            files = serving_files(path, self.dtype)
        start = time.monotonic()
        report = push(path, version_name(version), read_targets(urls, "", self.token, self.verify),
                      senders=self.senders, retries=self.retries, timeout_s=PUSH_TIMEOUT_S, files=files)
        seconds = time.monotonic() - start
        return [PushOutcome(url, version, ok=url not in report.failed, already=url in report.already, seconds=seconds,
                        reason=report.failed.get(url, "")) for url in urls]
