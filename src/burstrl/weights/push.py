"""Sharded HTTP(S) push of a version to every replica, one shard per trainer rank.

Flow for version `policy-vN` and W trainer ranks:

1. every rank packs the version directory into the same tar in memory (`Packer.pack` is
   deterministic; a trainer keeps one packer, so each version lands in the same buffer and every
   byte is read and hashed once per rank) cut into W shards, and `push_shards` sends its shards r, r+W, ... to all replicas
   in parallel (`PUT /v1/adapters/{name}/shards/{i}?of=W` with `X-Shard-SHA256`), to each
   replica's bulk listener (`GET /v1/adapters/bulk` names its port) or, without one, its main server;
2. after a barrier (the caller's), rank 0 calls `push_commit`: `PUT .../manifest`, `POST .../commit`
   on every replica that got all shards. A replica serves the version once its commit returns 200.

Why shards per rank: the bytes leave W machines at once, so publishing costs about 1/W of one
sender's uplink. Why faults are reported, not raised: one preempted replica must not stop training;
it is left out of this version (the report says why) and catches up from the volume.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from burstrl.protocol.adapters import Manifest, Packer
from burstrl.weights.bulk_send import BulkConnection

T = TypeVar("T")
R = TypeVar("R")
CONNECT_TIMEOUT_S = 5.0
SEND_CHUNK = 1 << 20
# Errors after which a request may be sent again: a shard or manifest PUT is idempotent.
TRANSIENT = (httpx.TransportError,)
# A commit consumes the replica's staging area whatever its outcome, so it is resent only when it
# never reached the replica.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass
class ReplicaTarget:
    """One replica's admin endpoint: base URL, bearer token, TLS verification (bool or CA file)."""

    url: str
    token: str
    verify: bool | str = True

    def client(self, timeout_s: float) -> httpx.Client:
        verify: bool | ssl.SSLContext = self.verify
        if isinstance(self.verify, str):
            verify = ssl.create_default_context(cafile=self.verify)
        return httpx.Client(base_url=self.url, verify=verify, trust_env=False,
                            headers={"Authorization": f"Bearer {self.token}"},
                            timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))


@dataclass
class PushReport:
    """What a push (or a phase of it, or one rank's part) achieved, by replica URL."""

    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # url -> reason (the replica's message)
    already: list[str] = field(default_factory=list)  # served the version before; nothing sent
    bytes_sent: int = 0
    seconds: float = 0.0
    retries: int = 0
    unloaded: dict[str, dict[str, str]] = field(default_factory=dict)  # url -> {name: state}

    @classmethod
    def merge(cls, reports: Iterable[PushReport]) -> PushReport:
        """Combine reports of ranks (or phases): a target failed anywhere is failed.

        `seconds` is the longest one (ranks run in parallel); a caller timing phases that ran one
        after the other sets it from its own clock.
        """
        out = cls()
        for rep in reports:
            out.failed.update(rep.failed)
            out.ok += [u for u in rep.ok if u not in out.ok]
            out.already += [u for u in rep.already if u not in out.already]
            out.bytes_sent += rep.bytes_sent
            out.retries += rep.retries
            out.seconds = max(out.seconds, rep.seconds)
            for url, names in rep.unloaded.items():
                out.unloaded.setdefault(url, {}).update(names)
        out.ok = [u for u in out.ok if u not in out.failed]
        out.already = [u for u in out.already if u not in out.failed]
        return out

    def usable(self, targets: list[ReplicaTarget]) -> list[ReplicaTarget]:
        """The targets that have not failed (what rank 0 commits to after the barrier)."""
        return [t for t in targets if t.url not in self.failed]

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": self.failed, "already": self.already,
                "bytes_sent": self.bytes_sent, "seconds": round(self.seconds, 4),
                "retries": self.retries, "unloaded": self.unloaded}


class TargetFailed(Exception):
    """A replica refused a request (4xx) or kept failing after the retries."""


def push_shards(version_dir: Path, name: str, targets: list[ReplicaTarget], rank: int, world_size: int,
                retries: int = 3, backoff_s: float = 0.2, timeout_s: float = 120.0,
                packer: Packer | None = None,
                files: dict[str, bytes] | None = None) -> tuple[Manifest, PushReport]:
    """Rank `rank` of `world_size`: send shards rank, rank+W, ... of the packed version to all targets.

    Returns the manifest too, so rank 0 commits without packing the version again; `packer` (kept
    by the caller from version to version) reuses its buffer; `files` (the two files' bytes, e.g.
    `trainer.publish.serving_files`) are packed instead of reading `version_dir`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    manifest, shards = _pack(packer or Packer(), version_dir, world_size, name, files)
    return manifest, send_shards(manifest, shards, targets, rank, world_size, retries, backoff_s, timeout_s)


def send_shards(manifest: Manifest, shards: list[bytes] | list[memoryview], targets: list[ReplicaTarget], rank: int,
                world_size: int, retries: int = 3, backoff_s: float = 0.2,
                timeout_s: float = 120.0, bulk: bool = True) -> PushReport:
    """`push_shards` for an already packed version (so one process can pack once for all senders).

    `bulk=False` sends over the replicas' main servers even where a bulk listener is up (to
    compare the two paths).
    """
    mine = list(range(rank, manifest.num_shards, world_size))

    def send(target: ReplicaTarget, client: httpx.Client, report: PushReport) -> None:
        if _serves(client, manifest.name, report, retries, backoff_s):
            report.already.append(target.url)
            return
        fast = bulk_connection(target, client, timeout_s) if bulk else None
        try:
            for i in mine:
                path, params = f"/v1/adapters/{manifest.name}/shards/{i}", {"of": manifest.num_shards}
                headers = {"X-Shard-SHA256": manifest.shard_sha256[i]}
                if fast is not None:
                    bulk_put(fast, path, params, shards[i], headers, report, retries, backoff_s)
                else:
                    call_with_retries(client, "PUT", path, report, retries, backoff_s, TRANSIENT,
                                      body=shards[i], params=params, headers=headers)
                report.bytes_sent += len(shards[i])
        finally:
            if fast is not None:
                fast.close()

    return for_each_target(targets, timeout_s, send)


def bulk_connection(target: ReplicaTarget, client: httpx.Client, timeout_s: float) -> BulkConnection | None:
    """A connection to the replica's bulk shard listener (`inference.bulk`), None to use its main server.

    The listener is on the replica's host at the port `GET /v1/adapters/bulk` names; a replica
    without one (turned off, or an older version answering 404), or whose bulk port cannot be
    reached from here, takes shards on its main server.
    """
    try:
        r = client.get("/v1/adapters/bulk")
    except httpx.HTTPError as exc:
        raise TargetFailed(f"GET /v1/adapters/bulk: {type(exc).__name__}: {exc}") from None
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise TargetFailed(f"GET /v1/adapters/bulk: HTTP {r.status_code}: {_message(r)}")
    try:
        port = r.json().get("port")
    except (ValueError, AttributeError):
        raise TargetFailed(f"GET /v1/adapters/bulk: not a JSON object: {r.text[:200]!r}") from None
    if type(port) is not int:
        return None
    url = httpx.URL(target.url)
    conn = BulkConnection(url.host, port, target.token, url.scheme == "https", target.verify, timeout_s,
                          CONNECT_TIMEOUT_S)
    try:
        conn.connect()
    except OSError:  # the port is not reachable from here (only the main one forwarded, a firewall)
        conn.close()
        return None
    return conn


def bulk_put(conn: BulkConnection, path: str, params: dict[str, Any], body: bytes | memoryview, headers: dict[str, str],
             report: PushReport, retries: int, backoff_s: float) -> None:
    """`call_with_retries` for a shard PUT on the bulk listener: the same backoff, 4xx fails at once."""
    reason = ""
    for attempt in range(retries + 1):
        if attempt:
            report.retries += 1
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            status, answer = conn.put(path, params, body, headers)
        except (ConnectionRefusedError, ssl.SSLCertVerificationError) as exc:  # retrying cannot help
            raise TargetFailed(f"PUT {path} (bulk): {type(exc).__name__}: {exc}") from None
        except OSError as exc:  # reset, timeout, a broken answer: the PUT is idempotent
            reason = f"PUT {path} (bulk): {type(exc).__name__}: {exc}"
            continue
        if status < 400:
            return
        reason = f"PUT {path} (bulk): HTTP {status}: {_error_text(answer)}"
        if status < 500:
            raise TargetFailed(reason)
    raise TargetFailed(f"{reason} (after {retries} retries)")


def for_each_target(targets: list[ReplicaTarget], timeout_s: float,
                    work: Callable[[ReplicaTarget, httpx.Client, PushReport], None]) -> PushReport:
    """Run `work` for every target in parallel, each with its own client and report.

    A target whose work raises TargetFailed is reported failed (with the reason), never raised;
    one that finishes is ok. `seconds` is the wall time of the whole.
    """
    start = time.monotonic()

    def one(target: ReplicaTarget) -> PushReport:
        report = PushReport()
        with target.client(timeout_s) as client:
            try:
                work(target, client, report)
            except TargetFailed as exc:
                report.failed[target.url] = str(exc)
                return report
        report.ok.append(target.url)  # `already` targets are ok too
        return report

    report = PushReport.merge(in_parallel(one, targets))
    report.seconds = time.monotonic() - start
    return report


def push_commit(version_dir: Path, name: str, targets: list[ReplicaTarget], world_size: int,
                retries: int = 3, backoff_s: float = 0.2, timeout_s: float = 120.0, *,
                manifest: Manifest | None = None) -> PushReport:
    """Rank 0, after every rank's `push_shards`: send the manifest and commit on each target.

    Pass only the targets no rank failed (`PushReport.merge(...).usable(targets)`). `manifest`
    skips packing the version again when the caller already has it.
    """
    if manifest is None:
        manifest, _ = Packer().pack(version_dir, world_size, name)  # the manifest only: no copies
    if manifest.name != name or manifest.num_shards != world_size:
        raise ValueError(f"manifest is for {manifest.name!r} in {manifest.num_shards} shards")

    def commit(target: ReplicaTarget, client: httpx.Client, report: PushReport) -> None:
        if _serves(client, name, report, retries, backoff_s):
            report.already.append(target.url)
            return
        call_with_retries(client, "PUT", f"/v1/adapters/{name}/manifest", report, retries,
                          backoff_s, TRANSIENT, json=manifest.to_json())
        call_with_retries(client, "POST", f"/v1/adapters/{name}/commit", report, retries,
                          backoff_s, NOT_SENT, retry_5xx=False)

    return for_each_target(targets, timeout_s, commit)


def push(version_dir: Path, name: str, targets: list[ReplicaTarget], senders: int = 1, retries: int = 3,
         backoff_s: float = 0.2, timeout_s: float = 120.0, packer: Packer | None = None,
         files: dict[str, bytes] | None = None) -> PushReport:
    """One process playing `senders` ranks: pack once, send shards from `senders` threads, commit.

    For tests, benchmarks and single-process trainers; `seconds` is the wall time of it all.
    `packer` and `files` as in `push_shards`.
    """
    start = time.monotonic()
    manifest, shards = _pack(packer or Packer(), version_dir, senders, name, files)

    def rank(r: int) -> PushReport:
        return send_shards(manifest, shards, targets, r, senders, retries, backoff_s, timeout_s)

    sent = PushReport.merge(in_parallel(rank, list(range(senders))))
    committed = push_commit(version_dir, name, sent.usable(targets), senders, retries, backoff_s,
                            timeout_s, manifest=manifest)
    report = PushReport.merge([sent, committed])
    report.seconds = time.monotonic() - start
    return report


def _pack(packer: Packer, version_dir: Path, num_shards: int, name: str,
          files: dict[str, bytes] | None) -> tuple[Manifest, list[memoryview]]:
    if files is not None:
        return packer.pack_bytes(files, num_shards, name)
    return packer.pack(version_dir, num_shards, name)


def read_targets(urls: list[str], urls_file: str, token: str,
                 verify: bool | str = True) -> list[ReplicaTarget]:
    """Replica targets from URLs plus a file of URLs (one a line, `#` starts a comment); deduplicated."""
    lines = list(urls)
    if urls_file:
        lines += [line.split("#", 1)[0] for line in Path(urls_file).read_text().splitlines()]
    out: list[ReplicaTarget] = []
    for line in lines:
        url = line.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
        if url not in [t.url for t in out]:
            out.append(ReplicaTarget(url=url, token=token, verify=verify))
    return out


def in_parallel(fn: Callable[[T], R], items: list[T]) -> list[R]:
    """Run `fn` on every item, one thread each (replicas are slow independently of each other)."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


def _serves(client: httpx.Client, name: str, report: PushReport, retries: int, backoff_s: float) -> bool:
    """Whether the replica already serves `name` (versions never change: nothing to send again)."""
    r = call_with_retries(client, "GET", "/v1/models", report, retries, backoff_s, TRANSIENT)
    return any(m.get("id") == name for m in r.json().get("data", []))


def call_with_retries(client: httpx.Client, method: str, path: str, report: PushReport, retries: int,
                      backoff_s: float, retry_on: tuple[type[Exception], ...], retry_5xx: bool = True,
                      body: bytes | memoryview | None = None, **kwargs: Any) -> httpx.Response:
    """One request with exponential backoff on `retry_on` errors and 5xx; 4xx fails at once.

    `body` is sent in slices (`_slices`), afresh on every attempt.
    """
    for attempt in range(retries + 1):
        if attempt:
            report.retries += 1
            time.sleep(backoff_s * 2 ** (attempt - 1))
        if body is not None:
            kwargs["content"] = _slices(body)
            kwargs["headers"] = {**kwargs.get("headers", {}), "Content-Length": str(len(body))}
        try:
            r = client.request(method, path, **kwargs)
        except retry_on as exc:
            reason = f"{method} {path}: {type(exc).__name__}: {exc}"
            if _refused(exc):
                raise TargetFailed(reason) from None  # nothing listens: the replica is gone
            continue
        except httpx.HTTPError as exc:
            raise TargetFailed(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if r.status_code < 400:
            return r
        reason = f"{method} {path}: HTTP {r.status_code}: {_message(r)}"
        if r.status_code < 500 or not retry_5xx:
            raise TargetFailed(reason)
    raise TargetFailed(f"{reason} (after {retries} retries)")


def _refused(exc: Exception) -> bool:
    """A refused connection: nothing listens there, so retrying only delays the push to the others.

    Why not retry: a replica restarts on a new port (and loads the newest version from the volume
    itself), so a refused port is a dead replica; backing off on it made the train step that spans
    a replica loss ~1.4 s longer per push phase.
    """
    return isinstance(exc, httpx.ConnectError) and "refused" in str(exc).lower()


def _slices(data: bytes | memoryview) -> Iterator[memoryview]:
    """`data` in 1 MiB views, for a body of known length.

    Why: given one large bytes body, httpcore re-slices `buffer[n:]` after every partial socket
    send, copying the rest of the body each time; a 100 MB shard then goes at ~200 MB/s on
    loopback, in slices at ~2.5 GB/s.
    """
    view = memoryview(data)
    for start in range(0, len(data), SEND_CHUNK):
        yield view[start:start + SEND_CHUNK]


def _message(r: httpx.Response) -> str:
    """The replica's error message (OpenAI error shape), else the start of the body."""
    return _error_text(r.content)


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")
