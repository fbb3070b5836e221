"""A sandbox pool across node agents (issue 18): `ClusterPool` places each sandbox on one of several
`burstrl sandbox node` agents with a `placement` policy and hands back a `Sandbox` whose daemon is
reached directly at the port the agent forwards on its node (commands never pass through here).

It has the surface the SWE env uses of `SandboxPool` (`create(spec, timeout)`, `close_all`, `live`,
a bound on sandboxes alive at once), so the agent loop and the grader are unchanged.

Why placement decides here, from cached reports, and not by asking every agent per sandbox: a
decision then costs microseconds, and sandboxes this pool placed but the last report does not show
yet are added to the node's state, so a burst of creates spreads instead of piling on the node that
looked emptiest a second ago. An agent still refuses (409/429) past its allocatable; the pool then
tries the next best node.

Node loss: a monitor thread reads every agent's report each `refresh_s`; an agent that has not
answered for `dead_after_s` is dead for good (a restarted agent is a new node with a new address).
Its sandboxes died with it (they are the agent's children). `confirm_lost(sandbox)` tells the env
whether a sandbox that stopped answering went down with its node (infrastructure: the attempt is
re-run) or alone, on a live node (the model's doing). It probes the agent itself rather than trust
the monitor's last view, since the harness sees a sandbox error before the monitor's deadline.

Nodes that join: given `nodes_file`, the monitor re-reads it whenever it changes (its mtime, size or
inode: the Ray launcher replaces it atomically) and adds the agents it does not know. An address the
pool knows, dead or alive, is never added again; a node dropped from the file is left to the monitor.
With a nodes file the pool may start empty (a run whose sandbox nodes have not joined, or an
orchestrator restarted while none was left), and a create waits for a node to join up to its
timeout (the env's attempt then fails as infrastructure and is re-run) rather than failing the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from burstrl.sandbox.backends.base import CLOSE_GRACE_S, LimitsReport, Sandbox, SandboxSpec
from burstrl.sandbox.node_client import NodeClient, NodeError, SandboxAddress, node_state
from burstrl.sandbox.placement import Layer, NodeState, PlacedSandbox, Policy, Resources, SandboxRequest, make_policy

log = logging.getLogger("burstrl.sandbox.cluster")


@dataclass(frozen=True)
class NodeRef:
    """Where one node agent answers and its bearer token."""

    url: str
    token: str
    name: str = ""


def load_nodes(path: Path | str, allow_empty: bool = False) -> list[NodeRef]:
    """A nodes file: a JSON list of {"url", "token", "name"?} (the Ray launcher writes one, mode 0600)."""
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or not (rows or allow_empty):
        raise ValueError(f"{path}: expected a non-empty JSON list of {{url, token}}")
    return [NodeRef(str(r["url"]), str(r["token"]), str(r.get("name", ""))) for r in rows]


@dataclass
class _Node:
    """One agent as the pool sees it: its last report, what the pool placed there since, its health."""

    ref: NodeRef
    api: NodeClient  # creates and deletes (a start may take long)
    probe: NodeClient  # reports and health (short timeout: a silent agent must not stall the monitor)
    name: str
    state: NodeState | None = None  # from the last report
    dead: bool = False
    failing_since: float | None = None
    placed: dict[str, PlacedSandbox] = field(default_factory=dict)  # by this pool, alive or starting
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)


class ClusterPool:
    """Sandboxes on node agents; at most `max_concurrent` alive at once (None: no bound of its own)."""

    def __init__(self, nodes: Sequence[NodeRef], policy: str | Policy = "ours", max_concurrent: int | None = 64,
                 refresh_s: float = 1.0, dead_after_s: float = 10.0, probe_timeout_s: float = 5.0,
                 create_timeout_s: float = 180.0, client_timeout_s: float = 60.0,
                 nodes_file: Path | str | None = None) -> None:
        if not nodes and not nodes_file:
            raise ValueError("a cluster pool needs at least one node agent, or a nodes file they join through")
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.max_concurrent = max_concurrent
        self.refresh_s, self.dead_after_s, self.client_timeout_s = refresh_s, dead_after_s, client_timeout_s
        self.create_timeout_s, self.probe_timeout_s = create_timeout_s, probe_timeout_s
        # replaced, never mutated, when a node joins: a reader iterating the old list stays consistent
        self.nodes = [self._node(ref) for ref in nodes]
        self.nodes_file = Path(nodes_file) if nodes_file else None
        self._file_seen: tuple[int, int, int] | None = None  # the first tick reads it (it may have changed)
        self._slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._seq = 0
        self.counts = {"created": 0, "closed": 0, "refused": 0, "create_errors": 0, "close_errors": 0,
                       "report_errors": 0, "nodes_lost": 0, "sandboxes_lost": 0, "nodes_joined": 0,
                       "nodes_file_errors": 0, "monitor_errors": 0}
        self.decision_s: deque[float] = deque(maxlen=10_000)  # placement decision latencies
        self._stop = threading.Event()
        self._reader = ThreadPoolExecutor(max_workers=16, thread_name_prefix="node-report")  # threads made lazily
        self.refresh()
        self._monitor = threading.Thread(target=self._monitor_loop, name="node-monitor", daemon=True)
        self._monitor.start()

    # -- placing

    def create(self, spec: SandboxSpec | None = None, timeout: float | None = None) -> Sandbox:
        """Place and start one sandbox, waiting up to `timeout` s for a slot and a node that admits it."""
        spec = spec or SandboxSpec()
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._slots is not None and not self._slots.acquire(timeout=timeout):
            raise TimeoutError(f"no free sandbox slot within {timeout}s ({self.max_concurrent} running)")
        try:
            return self._place(spec, deadline)
        except BaseException:
            self._release()
            raise

    def _place(self, spec: SandboxSpec, deadline: float | None) -> Sandbox:
        request = self._request(spec)
        body = self._body(spec, self.policy.requests(request))
        refused: set[str] = set()  # nodes that said no to this sandbox since the last report
        while True:
            node, key = self._choose(request, refused, deadline)
            try:
                address = node.api.create(**body)
            except NodeError as exc:
                self._unplace(node, key)
                if exc.status in (409, 429, 503):  # full, or unreachable (the monitor judges it): try another
                    with self._lock:
                        self.counts["refused"] += 1
                    refused.add(node.name)
                    continue
                with self._lock:
                    self.counts["create_errors"] += 1
                raise
            return self._adopt(node, key, address, request, spec)

    def _choose(self, request: SandboxRequest, refused: set[str], deadline: float | None) -> tuple[_Node, str]:
        """The policy's node (reserved for the sandbox under a placeholder key), waiting while none admits it."""
        with self._changed:
            while True:
                t0 = time.perf_counter()
                live = [n for n in self.nodes if not n.dead and n.state is not None and n.name not in refused]
                states = [self._view(n) for n in live]
                chosen = self.policy.choose(states, request)
                self.decision_s.append(time.perf_counter() - t0)
                if chosen is not None:
                    node = live[states.index(chosen)]
                    self._seq += 1
                    key = f"placing-{self._seq}"
                    node.placed[key] = self._placed(key, request)
                    return node, key
                if self.nodes_file is None and all(n.dead for n in self.nodes):  # and none can join
                    raise RuntimeError(f"every node agent is dead ({', '.join(n.name for n in self.nodes)})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no node admitted sandbox {request.name} in time "
                                       f"({sum(not n.dead for n in self.nodes)} of {len(self.nodes)} nodes alive)")
                self._changed.wait(min(self.refresh_s * 2, left) if left is not None else self.refresh_s * 2)
                refused.clear()  # a fresh report may show room again

    def _view(self, node: _Node) -> NodeState:
        """The node's last report plus what this pool placed there that the report does not show yet."""
        assert node.state is not None
        shown = [s if s.name not in node.placed or _measured(s) else node.placed[s.name]
                 for s in node.state.sandboxes]  # no samples yet: its prior, not zero use
        names = {s.name for s in shown}
        extra = [p for k, p in node.placed.items() if k not in names]
        return dataclasses.replace(node.state, sandboxes=shown + extra)

    def _placed(self, name: str, request: SandboxRequest) -> PlacedSandbox:
        lim = request.limits
        return PlacedSandbox(name, self.policy.requests(request), lim, request.prior.cpu.scaled(lim.cpu),
                             request.prior.mem.scaled(lim.mem))

    def _unplace(self, node: _Node, key: str) -> None:
        with self._changed:
            node.placed.pop(key, None)
            self._changed.notify_all()

    def _adopt(self, node: _Node, key: str, address: SandboxAddress, request: SandboxRequest,
               spec: SandboxSpec) -> Sandbox:
        client = address.client(timeout=self.client_timeout_s)
        sandbox = Sandbox(address.id, client, _limits(address), Path(f"{node.name}:{address.id}"),
                          lambda: self._delete(node, address.id, client))
        sandbox.node = node.name  # type: ignore[attr-defined]
        with self._changed:
            node.placed.pop(key, None)
            lost = node.dead
            if not lost:
                node.placed[address.id] = self._placed(address.id, request)
                node.sandboxes[address.id] = sandbox
                self.counts["created"] += 1
        if lost:  # the node died while the sandbox started: it is gone already (`create` frees the slot)
            sandbox.close()
            raise NodeError(503, f"node {node.name} died while sandbox {address.id} started")
        sandbox.on_close(lambda: self._forget(node, address.id))
        return sandbox

    def _delete(self, node: _Node, sid: str, client: Any) -> None:
        client.close(timeout=CLOSE_GRACE_S)
        if node.dead:
            return  # its sandboxes died with the agent
        try:
            node.api.delete(sid)
        except NodeError as exc:  # already gone (404), or the agent is failing: its monitor decides
            if exc.status != 404:
                with self._lock:
                    self.counts["close_errors"] += 1
                log.warning("closing sandbox %s on %s: %s", sid, node.name, exc)

    def _forget(self, node: _Node, sid: str) -> None:
        with self._changed:
            node.placed.pop(sid, None)
            if node.sandboxes.pop(sid, None) is None:
                return
            self.counts["closed"] += 1
            self._changed.notify_all()
        self._release()

    def _release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    @staticmethod
    def _request(spec: SandboxSpec) -> SandboxRequest:
        layers: tuple[Layer, ...] = ()
        if spec.image is not None:
            layers = _image_layers(str(spec.image))
        limits = Resources(spec.cpu_limit, float(spec.memory_limit_mb << 20), spec.pids_limit)
        return SandboxRequest(str(spec.image or "host"), layers, limits)

    @staticmethod
    def _body(spec: SandboxSpec, requests: Resources) -> dict[str, Any]:
        """The agent's create body, with the policy's requests (so the agent admits by the same numbers)."""
        body: dict[str, Any] = {
            "cpu_limit": spec.cpu_limit, "memory_limit_mb": spec.memory_limit_mb, "pids_limit": spec.pids_limit,
            "workdir_mb": spec.workdir_mb, "start_timeout_s": spec.start_timeout_s,
            "cpu_request": min(spec.cpu_limit, max(0.001, round(requests.cpu, 3))),
            "memory_request_mb": min(spec.memory_limit_mb, max(1, int(requests.mem) >> 20))}
        if spec.env:
            body["env"] = dict(spec.env)
        if spec.image is not None:
            body["image"] = str(spec.image)
        return body

    # -- health

    def refresh(self) -> None:
        """Read every live agent's report once (in parallel); agents silent for `dead_after_s` die."""
        live = [n for n in self.nodes if not n.dead]
        for node, report in zip(live, self._reader.map(_read_report, live), strict=True):
            now = time.monotonic()
            if isinstance(report, dict):
                state = node_state(report)
                with self._changed:
                    node.state, node.failing_since = state, None
                    self._changed.notify_all()
                continue
            with self._lock:
                self.counts["report_errors"] += 1
                node.failing_since = node.failing_since or now
                overdue = now - node.failing_since >= self.dead_after_s
            if overdue:
                self._mark_dead(node, report)

    def _monitor_loop(self) -> None:
        """The pool's only view of its nodes: a round that raises is counted and logged, and the next
        round runs (a monitor that died silently never adopted or buried a node again)."""
        while not self._stop.wait(self.refresh_s):
            try:
                self.watch_nodes_file()
                self.refresh()
            except Exception:
                with self._lock:
                    self.counts["monitor_errors"] += 1
                log.exception("node monitor round failed; the next round runs in %.1f s", self.refresh_s)

    def _node(self, ref: NodeRef) -> _Node:
        return _Node(ref, NodeClient(ref.url, ref.token, self.create_timeout_s),
                     NodeClient(ref.url, ref.token, self.probe_timeout_s), ref.name or ref.url)

    def _file_key(self) -> tuple[int, int, int] | None:
        if self.nodes_file is None:
            return None
        try:
            st = self.nodes_file.stat()
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def watch_nodes_file(self) -> list[str]:
        """Add the agents a changed nodes file lists that this pool never knew; their names.

        A file that fails to parse is counted and read again on its next change (the launcher writes
        it atomically, so that means a hand edit went wrong, not a torn read)."""
        key = self._file_key()
        if key is None or key == self._file_seen:
            return []
        self._file_seen = key
        try:
            refs = load_nodes(self.nodes_file, allow_empty=True)  # type: ignore[arg-type]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            with self._lock:
                self.counts["nodes_file_errors"] += 1
            log.warning("nodes file %s: %s", self.nodes_file, exc)
            return []
        known = {n.ref.url for n in self.nodes}
        new = [self._node(ref) for ref in refs if ref.url not in known]
        if new:
            with self._changed:
                self.nodes = [*self.nodes, *new]
                self.counts["nodes_joined"] += len(new)
            log.info("node agents joined: %s", ", ".join(n.name for n in new))
        return [n.name for n in new]

    def _mark_dead(self, node: _Node, why: object) -> None:
        with self._changed:
            if node.dead:
                return
            node.dead = True
            lost = len(node.sandboxes)
            self.counts["nodes_lost"] += 1
            self.counts["sandboxes_lost"] += lost
            node.placed.clear()
            self._changed.notify_all()
        log.warning("node agent %s is dead (%s); its %d sandbox(es) are lost", node.name, why, lost)

    def confirm_lost(self, sandbox: Any) -> bool:
        """Whether `sandbox` (one of this pool's) went down with its node: True once its agent has not
        answered for `dead_after_s` (probed now, not taken from the monitor's last view)."""
        node = next((n for n in self.nodes if n.name == getattr(sandbox, "node", None)), None)
        if node is None:
            return False
        deadline = time.monotonic() + self.dead_after_s
        while not node.dead:
            if isinstance(_read_health(node), dict):
                return False
            if time.monotonic() >= deadline:
                self._mark_dead(node, "no answer to probes")
                break
            time.sleep(min(self.refresh_s, 1.0))
        return True

    def tracker(self) -> _Tracker:
        """A view that remembers what it creates (the grader's sandboxes), to ask later whether one was lost."""
        return _Tracker(self)

    # -- the SandboxPool surface

    @property
    def live(self) -> list[Sandbox]:
        with self._lock:
            return [s for n in self.nodes for s in n.sandboxes.values()]

    def close_all(self) -> None:
        for sandbox in self.live:
            sandbox.close()

    def close(self) -> None:
        """Close every sandbox, then stop the monitor."""
        self.close_all()
        self._stop.set()
        self._monitor.join(timeout=30)
        self._reader.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            per_node = {n.name: {"dead": n.dead, "sandboxes": len(n.sandboxes)} for n in self.nodes}
            return {**self.counts, "nodes": per_node}


class _Tracker:
    def __init__(self, pool: ClusterPool) -> None:
        self.pool, self.made = pool, []

    def create(self, spec: SandboxSpec | None = None, timeout: float | None = None) -> Sandbox:
        sandbox = self.pool.create(spec, timeout)
        self.made.append(sandbox)
        return sandbox

    def lost(self) -> bool:
        """Whether any sandbox made through this view went down with its node."""
        return any(self.pool.confirm_lost(s) for s in self.made)


def _read_report(node: _Node) -> dict[str, Any] | NodeError:
    try:
        return node.probe.report()
    except NodeError as exc:
        return exc


def _read_health(node: _Node) -> dict[str, Any] | NodeError:
    try:
        return node.probe.health()
    except NodeError as exc:
        return exc


def _measured(s: PlacedSandbox) -> bool:
    return s.mem.high > 0 or s.mem.mean > 0


def _limits(address: SandboxAddress) -> LimitsReport:
    return LimitsReport(**address.limits) if address.limits else LimitsReport()


_layer_cache: dict[str, tuple[Layer, ...]] = {}


def _image_layers(layout: str) -> tuple[Layer, ...]:
    """The image's layer digests and sizes (read once per layout path: images are immutable)."""
    if layout not in _layer_cache:
        from burstrl.sandbox.images import read_image

        _layer_cache[layout] = tuple(Layer(d.digest, d.size) for d in read_image(Path(layout)).layers)
    return _layer_cache[layout]

