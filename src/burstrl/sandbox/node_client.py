"""The harness's and the scheduler's side of a node agent (`sandbox/node.py`): create and delete
sandboxes, read the node report, turn it into a `placement.NodeState`, and talk to a node-made
sandbox's daemon directly.

Standard library only, like `client.py`.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from burstrl.sandbox.client import SandboxClient
from burstrl.sandbox.placement import NodeState, PlacedSandbox, Resources, Usage


class NodeError(Exception):
    """A call the agent refused (4xx) or failed (5xx); `status` 503 when it could not be reached."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


@dataclass(frozen=True)
class SandboxAddress:
    """Where a node-made sandbox's daemon answers: a TCP URL on the node, and on the node's own
    host also its unix socket (with the daemon's pid and uid, checked on each connection)."""

    id: str
    url: str
    token: str
    socket: str | None = None
    socket_pid: int | None = None  # the unix socket's listener, checked on each connection
    socket_uid: int | None = None
    pid: int | None = None  # the sandbox's top process on its node (not the agent)
    limits: dict[str, str] | None = None  # how the node enforced each limit (`LimitsReport` fields)

    def client(self, local: bool = False, timeout: float = 30.0) -> SandboxClient:
        """A daemon client: over the node's TCP port, or with `local` over the unix socket."""
        if local and self.socket:
            return SandboxClient(socket_path=self.socket, token=self.token, timeout=timeout,
                                 expected_pid=self.socket_pid, expected_uid=self.socket_uid)
        return SandboxClient(url=self.url, token=self.token, timeout=timeout)


class NodeClient:
    """Blocking calls to one node agent with its bearer token.

    `max_bytes` caps what one answer may hold (None: no cap) for callers that must not be made to
    buffer a broken or hostile agent's answer whole: the fleet's supervisor reads every node's report.
    """

    def __init__(self, url: str, token: str, timeout: float = 60.0, max_bytes: int | None = None) -> None:
        self.url, self.token, self.timeout, self.max_bytes = url.rstrip("/"), token, timeout, max_bytes

    def _read(self, resp: Any) -> bytes:
        """The answer's body, at most `max_bytes` (one more byte tells an answer over the cap)."""
        if self.max_bytes is None:
            return resp.read()
        raw = resp.read(self.max_bytes + 1)
        if len(raw) > self.max_bytes:
            raise NodeError(502, f"node agent {self.url} answered over {self.max_bytes} bytes")
        return raw

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(self._read(resp))
        except urllib.error.HTTPError as exc:
            raw = exc.read(self.max_bytes) if self.max_bytes is not None else exc.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:200].decode("utf-8", "replace")
            raise NodeError(exc.code, message) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            # HTTPException: an agent that dies mid-answer (IncompleteRead) is as unreachable as one that never answered
            raise NodeError(503, f"node agent {self.url} unreachable: {exc!r}") from None
        except ValueError as exc:  # not JSON: a broken or hostile agent, treated like a failing one
            raise NodeError(502, f"node agent {self.url} answered garbage: {exc}") from None

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def report(self) -> dict[str, Any]:
        return self._call("GET", "/v1/node")

    def owners(self) -> dict[str, str]:
        """{sandbox id: its tenant} from the report, for the node's own token (a tenant's sees only its
        own sandboxes, with no owner): how the fleet finds a quiet tenant's sandboxes. Sandboxes of no
        tenant (made with the node token) are left out; a report without owners is a broken agent's."""
        try:
            return {str(s["id"]): str(s["tenant"]) for s in self.report()["sandboxes"] if s.get("tenant")}
        except (KeyError, TypeError, AttributeError) as exc:
            raise NodeError(502, f"node agent {self.url} sent a report without its sandboxes: {exc!r}") from None

    def create(self, **spec: Any) -> SandboxAddress:
        """Start a sandbox on the node; `spec`: `SandboxSpec` fields (`image` a layout path on the node)."""
        a = self._call("POST", "/v1/sandboxes", spec)
        return SandboxAddress(a["id"], a["url"], a["token"], socket=a.get("socket"), socket_pid=a.get("socket_pid"),
                              socket_uid=a.get("socket_uid"), pid=a.get("pid"), limits=a.get("limits"))

    def delete(self, sid: str) -> None:
        self._call("DELETE", f"/v1/sandboxes/{sid}")


def _res(d: dict[str, Any]) -> Resources:
    return Resources(float(d["cpu"]), float(d["mem"]), int(d["pids"]))


def _usage(d: dict[str, Any]) -> Usage:
    return Usage(float(d["mean"]), float(d["var"]), float(d["high"]))


def node_state(report: dict[str, Any]) -> NodeState:
    """The `placement.NodeState` of a `GET /v1/node` report: what the live scheduler scores."""
    sandboxes = [PlacedSandbox(name=s["id"], requests=_res(s["requests"]), limits=_res(s["limits_requested"]),
                               cpu=_usage(s["usage"]["cpu"]), mem=_usage(s["usage"]["mem"]))
                 for s in report["sandboxes"]]
    others = report.get("others")  # a tenant's report: the other tenants' sandboxes as one aggregate
    if others and others.get("count"):
        sandboxes.append(PlacedSandbox(name="(other tenants)", requests=_res(others["requests"]),
                                       limits=_res(others["limits_requested"]), cpu=_usage(others["usage"]["cpu"]),
                                       mem=_usage(others["usage"]["mem"])))
    return NodeState(name=report["name"], allocatable=_res(report["allocatable"]), sandboxes=sandboxes,
                     layers={k: int(v) for k, v in report["layers"].items()})
