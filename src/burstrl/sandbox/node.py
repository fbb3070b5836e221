"""`burstrl sandbox node`: the agent on one sandbox node (issue 18).

It creates and closes the node's sandboxes with its backend (through a `SandboxPool`), owns the
node's layer cache, and reports what it holds in the shape placement reads (`node_client.node_state`
turns the report into a `placement.NodeState`). HTTP, bearer token (`--token-file` or env
BURSTRL_NODE_TOKEN): `GET /v1/node`, `POST /v1/sandboxes`, `DELETE /v1/sandboxes/{id}`; `GET /healthz`
needs no token. With the fleet's tenant key (`--tenant-key-file`) a tenant token acts for its tenant:
only its own sandboxes, under a cap per tenant (`node_tenants.py`) and a weighted fair share of the
node's slots (`node_shares.py`).

Why each sandbox gets a TCP port of its own on the node: a rollout's commands must not pass through
a central process, and a sandbox daemon listens on a unix socket only the node can reach. The agent
forwards the port to that socket (checking the listener's pid and uid, as `SandboxClient` does) and
the harness speaks to the daemon with the sandbox's token, as it does locally; a harness on the
same host may use the socket itself (the answer carries both).

Why stdlib `http.server`: the agent's calls are few and block for a sandbox start (seconds), so a
thread per request is the natural shape, and the agent stays free of the replica's async stack.

Ownership: the agent is the owner process of every sandbox it makes (bwrap dies with it); on
SIGTERM/SIGINT it closes them all; at start it sweeps what a killed predecessor left in its
state dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import signal
import stat
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from burstrl.protocol.http import error_body
from burstrl.protocol.process import OWNER_FILE, pid_alive, print_ready, write_owner
from burstrl.sandbox.backends import make_backend
from burstrl.sandbox.backends.base import Sandbox, SandboxSpec, read_owner
from burstrl.sandbox.forward import Forwarder
from burstrl.sandbox.node_shares import FairShares
from burstrl.sandbox.node_tenants import NodeTenancy, tenant_view
from burstrl.sandbox.nodeusage import Allocatable, ProcTable, Reading, meminfo, read_sandbox
from burstrl.sandbox.placement import Usage
from burstrl.sandbox.pool import SandboxPool, sweep_stale

MAX_BODY = 1 << 20
SPEC_FIELDS = {"image": str, "cpu_limit": float, "memory_limit_mb": int, "cpu_request": float,
               "memory_request_mb": int, "pids_limit": int, "workdir_mb": int, "env": dict,
               "start_timeout_s": float}
WINDOW = 300  # samples of usage kept per sandbox (5 min at the default 1 s interval)


class BadRequest(ValueError):
    """A client error: answered with `status` and the message, never raised past the handler."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_spec(body: Any) -> SandboxSpec:
    """A `SandboxSpec` from a request body, or BadRequest(400) naming the first wrong field."""
    if not isinstance(body, dict):
        raise BadRequest(400, "body must be a JSON object of SandboxSpec fields")
    unknown = sorted(set(body) - set(SPEC_FIELDS))
    if unknown:
        raise BadRequest(400, f"unknown field {unknown[0]!r}; known: {', '.join(sorted(SPEC_FIELDS))}")
    fields: dict[str, Any] = {}
    for name, value in body.items():
        kind = SPEC_FIELDS[name]
        if value is None and name in ("image", "cpu_request", "memory_request_mb"):
            continue
        if kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise BadRequest(400, f"{name} must be a {'whole ' if kind is int else ''}number, got {value!r}")
            if not 0 < value < 1e12:
                raise BadRequest(400, f"{name} must be positive, got {value!r}")
            fields[name] = kind(value)
        elif kind is dict:
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and "\0" not in k + v
                                                      for k, v in value.items()):
                raise BadRequest(400, f"{name} must be an object of strings")
            fields[name] = value
        else:
            if not isinstance(value, str) or not value or "\0" in value:
                raise BadRequest(400, f"{name} must be a non-empty string")
            if not Path(value, "index.json").is_file():
                raise BadRequest(400, f"image {value!r} is not an OCI layout on this node (no index.json)")
            fields[name] = Path(value)
    spec = SandboxSpec(**fields)
    if spec.cpu_request > spec.cpu_limit or spec.memory_request_mb > spec.memory_limit_mb:
        raise BadRequest(400, "a request must not be over its limit")
    return spec


@dataclass
class Held:
    """One sandbox of this node: its spec, forwarder, cgroup dirs, entry pid and usage samples."""

    sandbox: Sandbox
    spec: SandboxSpec
    forward: Forwarder
    cgroups: list[str]
    pid: int | None
    created: float = field(default_factory=time.time)
    cpu: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # vCPU over each interval
    mem: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # bytes
    last: Reading | None = None
    last_t: float = 0.0
    tenant: str | None = None  # its owner on a fleet's node (`node_tenants.py`); None: the node token's


def usage_of(samples: deque[float]) -> dict[str, float]:
    """Mean, variance and 90th percentile (`placement.Usage.of`, the predictor's input) as JSON."""
    return {**dataclasses.asdict(Usage.of(list(samples))), "samples": len(samples)}


class NodeAgent:
    """The node's sandboxes, layer cache and counters; thread-safe; `close()` closes every sandbox."""

    def __init__(self, name: str, backend: str, state_dir: Path, layer_cache: Any, host: str,
                 allocatable: Allocatable, max_sandboxes: int | None = None, sample_s: float = 1.0,
                 sweep_glob: str | None = None, tenancy: NodeTenancy | None = None) -> None:
        self.tenancy = tenancy or NodeTenancy()
        self.name, self.host, self.allocatable, self.sample_s = name, host, allocatable, sample_s
        self.state_dir = Path(state_dir)
        check_private_dir(self.state_dir)
        self.swept = sweep_stale(self.state_dir, min_age_s=0.0) if self.state_dir.is_dir() else []
        self.state_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        write_owner(self.state_dir, role="sandbox-node", name=name)  # a sibling's sweep skips a live agent's dir
        self.swept_dirs, self.sweep_errors = sweep_dead_agents(sweep_glob, self.state_dir) if sweep_glob else ([], [])
        self.layer_cache = layer_cache
        self.pool = SandboxPool(make_backend(backend, state_dir=self.state_dir, layer_cache=layer_cache),
                                max_concurrent=max_sandboxes)
        self.held: dict[str, Held] = {}
        self.shares = FairShares(self.tenancy, max_sandboxes)
        self._starting: list[tuple[SandboxSpec, str | None]] = []  # admitted, not yet running (and whose)
        self.counts = {"created": 0, "closed": 0, "create_failures": 0, "refused": 0, "evictions": 0,
                       "oom_kills_closed": 0, "sample_errors": 0, "server_errors": 0, "tenant_refused": 0,
                       "share_refused": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, name="node-sampler", daemon=True)
        self._sampler.start()

    # -- sandboxes

    def create(self, spec: SandboxSpec, tenant: str | None = None) -> dict[str, Any]:
        """Start a sandbox (owned by `tenant`) if its requests fit in what is left of allocatable and
        the tenant is under its cap and its fair share allows it; return its address."""
        with self._lock:
            live = self._live()
            unfair = self.shares.refusal(tenant, live, self.name)  # records the ask, refused or not
            why = self.tenancy.over_cap(tenant, live[tenant], self.name)
            if why or unfair:
                self.counts["tenant_refused" if why else "share_refused"] += 1
                raise BadRequest(429, why or unfair or "")
            specs = [h.spec for h in self.held.values()] + [s for s, _ in self._starting] + [spec]
            req_cpu = sum(s.cpu_request for s in specs)
            req_mem = sum(s.memory_request_mb for s in specs)
            if req_cpu > self.allocatable.cpu + 1e-9 or req_mem << 20 > self.allocatable.mem:
                self.counts["refused"] += 1
                raise BadRequest(409, f"requests would pass allocatable ({req_cpu:g} of {self.allocatable.cpu:g} "
                                      f"vCPU, {req_mem} of {self.allocatable.mem >> 20} MiB)")
            self._starting.append((spec, tenant))
        try:
            sandbox = self._start(spec)
        finally:
            with self._lock:
                self._starting.remove((spec, tenant))
        owner = read_owner(sandbox.path) or {}
        client = sandbox.client
        forward = Forwarder(self.host, client.socket_path, client.expected_pid, client.expected_uid)
        held = Held(sandbox, spec, forward, [str(d) for d in owner.get("cgroups") or []], owner.get("pid"),
                    tenant=tenant)
        with self._lock:
            self.held[sandbox.id] = held
            self.counts["created"] += 1
        return self.address(held)

    def _live(self) -> Counter[str | None]:
        """Running and starting sandboxes per owner (None: the node token's); under the lock."""
        return Counter([h.tenant for h in self.held.values()] + [t for _, t in self._starting])

    def _start(self, spec: SandboxSpec) -> Sandbox:
        try:
            return self.pool.create(spec, timeout=0)
        except TimeoutError as exc:
            with self._lock:
                self.counts["refused"] += 1
            raise BadRequest(429, str(exc)) from None
        except Exception:
            with self._lock:
                self.counts["create_failures"] += 1
            raise

    def address(self, held: Held) -> dict[str, Any]:
        c = held.sandbox.client
        owner = read_owner(held.sandbox.path) or {}
        return {"id": held.sandbox.id, "url": held.forward.url, "token": c.token, "socket": c.socket_path,
                # who listens on `socket` (checked per connection): the daemon, or where the agent made
                # the listener and handed it in (namespace backend), the agent itself
                "socket_pid": c.expected_pid, "socket_uid": c.expected_uid,
                "pid": owner.get("pid"),  # the sandbox's own top process (bwrap / the OCI runtime)
                "limits": {"cpu": held.sandbox.limits.cpu, "memory": held.sandbox.limits.memory,
                           "pids": held.sandbox.limits.pids, "disk": held.sandbox.limits.disk,
                           "oom": held.sandbox.limits.oom, "uid": held.sandbox.limits.uid}}

    def delete(self, sid: str, tenant: str | None = None) -> None:
        """Close sandbox `sid`; for a tenant only its own (another's is a 404, as an unknown id is)."""
        with self._lock:
            held = self.held.get(sid)
            if held is not None and (tenant is None or held.tenant == tenant):
                del self.held[sid]
            else:
                held = None
        if held is None:
            raise BadRequest(404, f"no sandbox {sid!r} on node {self.name}")
        self._close(held)

    def _close(self, held: Held) -> None:
        held.forward.close()
        if held.last is not None:
            with self._lock:
                self.counts["oom_kills_closed"] += held.last.oom_kills
        held.sandbox.close()
        with self._lock:
            self.counts["closed"] += 1

    def close(self) -> None:
        """Close every sandbox this agent owns, stop sampling, and remove its state dir once empty."""
        self._stop.set()
        with self._lock:
            held, self.held = list(self.held.values()), {}
        for h in held:
            self._close(h)
        self.pool.close_all()
        (self.state_dir / OWNER_FILE).unlink(missing_ok=True)
        _remove_empty_dirs(self.state_dir)

    # -- usage

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.sample_s):
            self.sample()

    def sample(self) -> None:
        """One reading of every sandbox: CPU as vCPU over the interval since the last reading."""
        procs = ProcTable()
        with self._lock:
            held = list(self.held.values())
        for h in held:
            try:
                r = read_sandbox(h.cgroups, h.pid, procs)
            except OSError:  # the sandbox closed under us; counted, the next tick skips it
                with self._lock:
                    self.counts["sample_errors"] += 1
                continue
            now = time.monotonic()
            if h.last is not None and now > h.last_t:
                h.cpu.append(max(0.0, r.cpu_seconds - h.last.cpu_seconds) / (now - h.last_t))
            h.mem.append(float(r.mem_bytes))
            h.last, h.last_t = r, now

    def report(self, tenant: str | None = None) -> dict[str, Any]:
        """The node as placement sees it (see `node_client.node_state`), plus counters and sources;
        for a tenant, its own sandboxes and the others as one aggregate (`node_tenants.tenant_view`)."""
        with self._lock:
            held = list(self.held.values())
            counts = dict(self.counts)
            shares = self.shares.report(self._live())
        sandboxes = []
        for h in held:
            s = h.spec
            sandboxes.append({
                **self.address(h), "token": None, "created": h.created, "tenant": h.tenant,
                "requests": {"cpu": s.cpu_request, "mem": s.memory_request_mb << 20, "pids": s.pids_limit},
                "limits_requested": {"cpu": s.cpu_limit, "mem": s.memory_limit_mb << 20, "pids": s.pids_limit},
                "usage": {"cpu": usage_of(h.cpu), "mem": usage_of(h.mem),
                          "cpu_source": h.last.cpu_source if h.last else "none",
                          "mem_source": h.last.mem_source if h.last else "none",
                          "oom_kills": h.last.oom_kills if h.last else 0},
                "forward_refused": h.forward.refused})
        oom_live = sum(x["usage"]["oom_kills"] for x in sandboxes)
        layers = self.layer_cache.layers() if self.layer_cache is not None else {}
        a = self.allocatable
        return tenant_view({
            "name": self.name, "backend": self.pool.backend.name, "time": time.time(),
            "allocatable": {"cpu": a.cpu, "mem": a.mem, "pids": a.pids},
            "mem_available": meminfo().get("MemAvailable", 0),
            "requested": {k: sum(x["requests"][k] for x in sandboxes) for k in ("cpu", "mem", "pids")},
            "limited": {k: sum(x["limits_requested"][k] for x in sandboxes) for k in ("cpu", "mem", "pids")},
            "sandboxes": sandboxes,
            "layers": layers, "layer_bytes": sum(layers.values()),
            "layer_cache": self.layer_cache.stats() if self.layer_cache is not None else None,
            "counts": {**counts, "oom_kills": counts["oom_kills_closed"] + oom_live},
            "notes": ["evictions: the agent evicts nothing yet (placement keeps requests and predicted peaks "
                      "under allocatable); the counter is there for when it does"],
            "swept_at_start": self.swept,
            "swept_agent_dirs": self.swept_dirs,
            "swept_agent_errors": self.sweep_errors,
            "shares": shares,
        }, tenant)


class _NodeHandler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # stderr per request is noise
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        try:
            status, body = 200, self._route(method)
        except BadRequest as exc:
            status, body = exc.status, error_body(exc.status, str(exc))
        except Exception as exc:  # a backend failure is the node's fault: a 500 with its message, counted
            self.server.agent.counts["server_errors"] += 1
            status, body = 500, error_body(500, f"{type(exc).__name__}: {exc}", "server_error")
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise BadRequest(411, "Content-Length required")
        if int(length) > MAX_BODY:
            self.close_connection = True
            raise BadRequest(413, f"body over {MAX_BODY} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw) if raw else {}
        except ValueError as exc:
            raise BadRequest(400, f"body is not valid JSON: {exc}") from None

    def _route(self, method: str) -> Any:
        agent = self.server.agent
        path = self.path.split("?", 1)[0]
        if path == "/healthz" and method == "GET":
            return {"status": "ok", "name": agent.name, "sandboxes": len(agent.held)}
        ok, tenant = agent.tenancy.caller({k.lower(): v for k, v in self.headers.items()}, self.server.token)
        if not ok:
            if method == "POST":
                self.close_connection = True  # the unread body must not be taken for the next request
            raise BadRequest(401, "missing or wrong bearer token")
        if path == "/v1/node" and method == "GET":
            return agent.report(tenant)
        if path == "/v1/sandboxes" and method == "POST":
            return agent.create(parse_spec(self._body()), tenant)
        if path.startswith("/v1/sandboxes/") and method == "DELETE":
            agent.delete(path.removeprefix("/v1/sandboxes/"), tenant)
            return {"deleted": path.removeprefix("/v1/sandboxes/")}
        if path in ("/healthz", "/v1/node", "/v1/sandboxes") or path.startswith("/v1/sandboxes/"):
            raise BadRequest(405, f"{method} not allowed on {path}")
        raise BadRequest(404, f"no route {path}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], agent: NodeAgent, token: str) -> None:
        super().__init__(addr, _NodeHandler)
        self.agent, self.token = agent, token


def read_token(token_file: str | None) -> str:
    """The agent's bearer token: the file's first line, else env BURSTRL_NODE_TOKEN (never argv)."""
    token = Path(token_file).read_text().strip() if token_file else os.environ.get("BURSTRL_NODE_TOKEN", "")
    if not token:
        raise ValueError("no node token: give --token-file or set BURSTRL_NODE_TOKEN")
    return token


def serve(agent: NodeAgent, host: str, port: int, token: str) -> None:
    """Serve until SIGTERM/SIGINT, then close every sandbox (the agent owns them)."""
    server = _Server((host, port), agent, token)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    h, p = server.server_address[:2]
    print_ready(f"http://{h if ':' not in str(h) else f'[{h}]'}:{p}")
    try:
        server.serve_forever()
    finally:
        server.server_close()
        agent.close()


def _remove_empty_dirs(root: Path) -> None:
    """`root` and the dirs under it, where nothing is left in them (the runtime's empty state dirs).

    Why: a Ray cluster starts an agent per node with a state dir named by the node's id, so every
    run left one behind in /tmp. Anything not empty (a sandbox that would not close) stays for the
    next agent's sweep."""
    if not root.is_dir():
        return
    for path in sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        with contextlib.suppress(OSError):  # not empty: kept
            path.rmdir()
    with contextlib.suppress(OSError):
        root.rmdir()


def sweep_dead_agents(pattern: str, own: Path, min_age_s: float = 600.0) -> tuple[list[str], list[str]]:
    """The state dirs matching `pattern` (not `own`) of agents that are gone: their sandboxes swept
    (processes, cgroups, mounts), then the dirs removed. Returns (dirs removed, errors).

    Why: a Ray cluster names each node's state dir by the node's id, so an agent that died (a
    preempted or failed node on a shared host) left dirs, and sandbox mounts, that no successor
    with another id would ever sweep. A dir whose agent still runs is left alone; one without an
    agent record only once older than `min_age_s` (an agent may be creating it). Agents starting
    together on one host sweep a dir one at a time (a lock on the dir), and a failure is reported,
    never raised: other agents' leftovers must not stop this one from serving."""
    removed, errors = [], []
    for path in sorted(Path(p) for p in glob.glob(pattern)):
        try:
            if _sweep_dead_agent(path, own, min_age_s):
                removed.append(str(path))
        except Exception as exc:  # tolerated and reported (swept_agent_errors): see the docstring
            errors.append(f"{path}: {type(exc).__name__}: {str(exc)[:200]}")
    return removed, errors


def _sweep_dead_agent(path: Path, own: Path, min_age_s: float) -> bool:
    """Sweep one dir if its agent is gone and no other agent is sweeping it; True once removed.

    Only a dir this uid owns and nobody else can write: /tmp is everyone's, and the sweep acts on
    the records it finds (kills their processes, removes their cgroups and mounts), so a record
    another user planted under a matching name must never be read."""
    if path.resolve() == own.resolve():
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # swept by another agent meanwhile, not a dir, or a symlink (O_NOFOLLOW)
        return False
    try:
        st = os.fstat(fd)  # the dir opened, not whatever the name points at later
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another agent is sweeping it now
            return False
        owner = read_owner(path)
        if owner is not None and pid_alive(int(owner.get("owner_pid", 0)), owner.get("owner_start")):
            return False
        if owner is None and time.time() - path.stat().st_mtime < min_age_s:
            return False
        sweep_stale(path, min_age_s=0.0)
        (path / OWNER_FILE).unlink(missing_ok=True)
        _remove_empty_dirs(path)
        return not path.exists()
    finally:
        os.close(fd)


def check_private_dir(path: Path) -> None:
    """Refuse a state dir that exists but is not this uid's alone (ValueError naming why).

    Why: the agent acts on the records it finds there at start (kills their processes, removes
    their cgroups and mounts), and the default lives in /tmp, where anyone can create the name first."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"state dir {path} is not a directory (a link or a file): refusing to use it")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ValueError(f"state dir {path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
                         f"refusing to use a dir another user can write or own")
