"""Sandboxes: start and command latency of namespace, oci+runc, oci+runsc and SWE-ReX through one
client; start with an image cached vs not; zstd vs gzip; concurrency.

All figures come from one invocation on this machine:
- compare (the headline): start -> first `true` answered, p50/p99 over `--repeats` starts, and
  `true` latency p50/p99 over `--n` calls on a warm instance, for burstrl's sandboxd in a
  namespace (bubblewrap), oci+runc and oci+runsc (gVisor) sandbox, for the same daemon on the host
  (no sandbox), and for SWE-ReX 1.4.0's server on the host (a daemon, not a sandbox: its start is
  process spawn -> first command answered). Every system is driven by the same client,
  `sandbox_client.BenchClient` (stdlib `http.client`, keep-alive HTTP/1.1), over a unix socket;
  the two host daemons are also timed over TCP 127.0.0.1 (sandboxes have no network). Systems are
  interleaved (round-robin, in chunks) so the machine's noise falls on all of them alike. Bare
  `subprocess.run(["true"])` is the floor; burstrl's own `SandboxClient` is shown for reference.
- start of a namespace sandbox with an image built from a task-like tree (a copy of an installed
  package, ~17 MB) whose layers are (a) already in the node cache or (b) not (a fresh cache each
  time), and with no image. Goal on a hit: <= 0.3 s.
- the same layer unpacked as tar+zstd vs tar+gzip, end to end.
- N namespace sandboxes started at once (8, 32, 64): start p50/p99 and failures (goal: 0).

    .venv/bin/python benchmarks/sandbox.py            # ~3.5 min
    .venv/bin/python benchmarks/sandbox.py --quick    # < 1 min: fewer repetitions, N = 8 only

Prints one JSON object, then the comparison as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from sandbox_client import BenchClient, burstrl_client, burstrl_exec_true  # noqa: E402
from swerex_side import SwerexServer, execute_true, session_true  # noqa: E402
from unpack import measure as measure_unpack  # noqa: E402

from burstrl.sandbox.backends import SandboxSpec, make_backend  # noqa: E402
from burstrl.sandbox.backends.oci import runtime_works  # noqa: E402
from burstrl.sandbox.images import (  # noqa: E402
    GZIP_LEVEL,
    ZSTD_LEVEL,
    build_image,
)
from burstrl.sandbox.layercache import LayerCache, force_rmtree  # noqa: E402


def percentiles(ms: list[float]) -> dict[str, float]:
    """p50 and p99 by nearest rank (with fewer than 100 samples p99 is the largest)."""
    ms = sorted(ms)
    return {"p50": round(ms[len(ms) // 2], 3), "p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3)}


def task_tree() -> Path:
    """A real tree to pack as a task image: the largest of a few installed pure-Python packages."""
    import fastapi
    import pydantic

    candidates = [Path(pydantic.__file__).parent, Path(fastapi.__file__).parent]
    try:
        import networkx  # noqa: F401

        candidates.append(Path(networkx.__file__).parent)
    except ImportError:
        pass
    return max(candidates, key=lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()))


def time_start(backend, spec: SandboxSpec) -> float:
    """Seconds from `create` to the first `true` answered (through the shared bench client)."""
    t0 = time.perf_counter()
    sb = backend.create(spec)
    try:
        with burstrl_client(sb.client.socket_path, sb.client.token) as c:
            burstrl_exec_true(c)
        return time.perf_counter() - t0
    finally:
        sb.close()


def starts(root: Path, image: Path, repeats: int) -> dict:
    """Start -> first answer: no image, image cached, image not cached (fresh cache each time)."""
    cache = LayerCache(root / "cache-warm", max_bytes=2 << 30)
    warm = make_backend("namespace", state_dir=root / "s", layer_cache=cache)
    time_start(warm, SandboxSpec(image=image))  # fills the cache
    out = {"no_image_s": [time_start(warm, SandboxSpec()) for _ in range(repeats)],
           "image_cached_s": [time_start(warm, SandboxSpec(image=image)) for _ in range(repeats)]}
    cold = []
    for i in range(repeats):
        fresh = make_backend("namespace", state_dir=root / "s", layer_cache=LayerCache(root / f"cold-{i}", 2 << 30))
        cold.append(time_start(fresh, SandboxSpec(image=image)))
        shutil.rmtree(root / f"cold-{i}", ignore_errors=True)
    out["image_not_cached_s"] = cold
    return {k: {"median": round(statistics.median(v), 4), "max": round(max(v), 4)} for k, v in out.items()} | {
        "cache": cache.stats()}


class HostDaemon:
    """burstrl's sandboxd run directly on the host (no sandbox), on a unix socket or TCP."""

    def __init__(self, root: Path, tcp: bool = False):
        self.token = "bench-token"
        (root / "token").write_text(self.token)
        if tcp:
            from swerex_side import _free_port

            port = _free_port()
            where = ["--host", "127.0.0.1", "--port", str(port)]
            self.client = BenchClient(tcp=("127.0.0.1", port), headers={"X-Sandbox-Token": self.token})
        else:
            sock = str(root / "d.sock")
            if os.path.exists(sock):
                os.unlink(sock)
            where = ["--socket", sock]
            self.client = burstrl_client(sock, self.token)
        self.argv = [sys.executable, "-m", "burstrl.sandbox.daemon", *where, "--token-file", str(root / "token")]
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Spawn, connect as soon as it listens, run `true` once: seconds from spawn to that answer."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(REPO / "src")}, start_new_session=True)
        self.client.connect_waiting(lambda: self.proc.poll() is None)
        burstrl_exec_true(self.client)
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _backends(root: Path) -> tuple[dict, dict, list[str]]:
    """{name: backend} for namespace and each OCI runtime that works here, {name: skip reason}, state dirs."""
    found = {"namespace": make_backend("namespace", state_dir=root / "ns")}
    skipped, dirs = {}, []
    for runtime in ("runc", "runsc"):
        state = tempfile.mkdtemp(prefix="sbx", dir="/tmp")  # short: runsc's socket paths
        dirs.append(state)
        ok, why = runtime_works(runtime, Path(state))
        if ok:
            found[f"oci+{runtime}"] = make_backend("oci", state_dir=state, runtime=runtime)
        else:
            skipped[f"oci+{runtime}"] = why[:300]
    return found, skipped, dirs


def _round_robin(calls: dict, n: int, chunk: int) -> dict[str, list[float]]:
    """Milliseconds of `n` calls of each callable, interleaved `chunk` calls at a time."""
    out: dict[str, list[float]] = {name: [] for name in calls}
    while any(len(v) < n for v in out.values()):
        for name, call in calls.items():
            for _ in range(min(chunk, n - len(out[name]))):
                t = time.perf_counter()
                call()
                out[name].append((time.perf_counter() - t) * 1000)
    return out


def compare(root: Path, repeats: int, n: int) -> dict:
    """Start -> first `true`, and warm `true` latency, of every system through one client (see top)."""
    backends, skipped, dirs = _backends(root)
    transports = {name: "unix socket (host path of the sandbox's socket)" for name in backends}
    transports |= {"burstrl daemon on host": "unix socket", "SWE-ReX on host": "unix socket (uvicorn --uds)"}
    try:
        # -- start: round-robin over the systems, one start each per round
        def start_sandbox(backend):
            return lambda: time_start(backend, SandboxSpec())

        def start_daemon(make):
            def one() -> float:
                d = make()
                try:
                    return d.start()
                finally:
                    d.stop()
            return one

        start_calls = {name: start_sandbox(b) for name, b in backends.items()}
        start_calls["burstrl daemon on host"] = start_daemon(lambda: HostDaemon(root))
        start_calls["SWE-ReX on host"] = start_daemon(lambda: SwerexServer(uds=str(root / "swerex.sock")))
        for call in start_calls.values():  # one unmeasured start each: page cache, imports, pyc
            call()
        start_s: dict[str, list[float]] = {name: [] for name in start_calls}
        for _ in range(repeats):
            for name, call in start_calls.items():
                start_s[name].append(call())

        # -- warm `true` latency: everything up at once, calls interleaved 20 at a time
        sandboxes, daemons, calls = {}, [], {}
        try:
            for name, b in backends.items():
                sandboxes[name] = b.create(SandboxSpec())
            calls["bare subprocess.run"] = lambda: subprocess.run(["true"], check=True)
            for name, sb in sandboxes.items():
                c = burstrl_client(sb.client.socket_path, sb.client.token)
                calls[name] = lambda c=c: burstrl_exec_true(c)
            for tcp in (False, True):
                sub = root / ("t" if tcp else "u")
                sub.mkdir(exist_ok=True)
                d = HostDaemon(sub, tcp=tcp)
                d.start()
                daemons.append(d)
                calls["burstrl daemon on host" + (", TCP" if tcp else "")] = lambda c=d.client: burstrl_exec_true(c)
            swerex_uds = None
            for tcp in (False, True):
                s = SwerexServer(uds=None if tcp else str(root / "swerex.sock"))
                s.start()
                daemons.append(s)
                swerex_uds = swerex_uds or s
                calls["SWE-ReX on host" + (", TCP" if tcp else "")] = lambda c=s.client: execute_true(c)
            swerex_uds.open_session()
            calls["SWE-ReX bash session"] = lambda: session_true(swerex_uds.client)
            if "namespace" in sandboxes:
                own = sandboxes["namespace"]
                calls["namespace, burstrl's own SandboxClient"] = lambda: own.exec(["true"])
            for call in calls.values():
                call()  # warm: connection, pyc, page cache
            latency_ms = _round_robin(calls, n, chunk=20)
        finally:
            for d in daemons:
                d.stop()
            for sb in sandboxes.values():
                sb.close()
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    transports |= {"burstrl daemon on host, TCP": "TCP 127.0.0.1", "SWE-ReX on host, TCP": "TCP 127.0.0.1 (swerex-remote)",
                   "SWE-ReX bash session": "unix socket (uvicorn --uds)", "bare subprocess.run": "none (in process)",
                   "namespace, burstrl's own SandboxClient": "unix socket, burstrl's SandboxClient (reference only)"}
    start = {k: percentiles([s * 1000 for s in v]) for k, v in start_s.items()}
    latency = {k: percentiles(v) for k, v in latency_ms.items()}
    ns_start, ns_lat, bare = start.get("namespace"), latency.get("namespace"), latency["bare subprocess.run"]
    return {
        "client": "sandbox_client.BenchClient: stdlib http.client, keep-alive HTTP/1.1, one JSON POST per command",
        "command": "argv ['true'], no shell (burstrl POST /exec {'cmd': ['true']}; SWE-ReX POST /execute "
                   "{'command': ['true'], 'shell': false}; session: POST /run_in_session 'true')",
        "starts_per_system": repeats, "calls_per_system": n, "skipped": skipped, "transport": transports,
        "start_ms": start, "latency_ms": latency,
        "start_vs_namespace": {k: {q: round(v[q] / ns_start[q], 2) for q in v} for k, v in start.items()} if ns_start else None,
        "latency_vs_namespace": {k: {q: round(v[q] / ns_lat[q], 2) for q in v} for k, v in latency.items()} if ns_lat else None,
        "latency_vs_bare": {k: {q: round(v[q] / bare[q], 2) for q in v} for k, v in latency.items()},
    }


def table(cmp: dict) -> str:
    """The comparison as markdown: one row per system, start and `true` latency side by side."""
    head = ("| system | transport | start -> first `true`, p50 / p99 | vs namespace (p50) | `true` p50 / p99 | "
            "vs namespace (p50) | vs bare (p50) |")
    rows = [head, "|---|---|---|---|---|---|---|"]
    for name in cmp["latency_ms"] | cmp["start_ms"]:
        st, lat = cmp["start_ms"].get(name), cmp["latency_ms"].get(name)
        sv = (cmp["start_vs_namespace"] or {}).get(name)
        lv = (cmp["latency_vs_namespace"] or {}).get(name)
        rows.append(f"| {name} | {cmp['transport'].get(name, '')} | "
                    + (f"{st['p50'] / 1000:.3f} / {st['p99'] / 1000:.3f} s | {sv['p50']}x" if st else " | ")
                    + " | " + (f"{lat['p50']:.2f} / {lat['p99']:.2f} ms | {lv['p50'] if lv else ''}x | "
                               f"{cmp['latency_vs_bare'][name]['p50']}x" if lat else " | | ") + " |")
    for name, why in cmp["skipped"].items():
        rows.append(f"| {name} | skipped: {why} | | | | | |")
    return "\n".join(rows)


def concurrency(root: Path, sizes: list[int]) -> dict:
    """N sandboxes asked for at once (one thread each): per-sandbox start time and failures."""
    out = {}
    for n in sizes:
        backend = make_backend("namespace", state_dir=root / f"c{n}")

        def one(_: int, backend: Any = backend) -> float | str:
            try:
                return time_start(backend, SandboxSpec(cpu_limit=0.5, memory_limit_mb=256))
            except Exception as exc:  # counted: the figure is how many fail
                return f"{type(exc).__name__}: {exc}"

        with ThreadPoolExecutor(max_workers=n) as ex:
            t0 = time.perf_counter()
            results = list(ex.map(one, range(n)))
            wall = time.perf_counter() - t0
        ok = [r * 1000 for r in results if isinstance(r, float)]
        failures = [r for r in results if isinstance(r, str)]
        out[str(n)] = {"start_ms": percentiles(ok) if ok else None, "failures": len(failures),
                       "first_failure": failures[0][:300] if failures else None, "wall_s": round(wall, 2)}
    return out


def unpack_benchmark(src_dir: Path, repeats: int = 5, work: Path | None = None) -> dict[str, Any]:
    """Time unpacking the same tar of `src_dir` as tar+zstd (level 3) vs tar+gzip (level 6).

    End to end, as a node does on a cache miss (read the blob, decompress, verify the digest,
    extract), with decompression, tar parsing and file creation split (benchmarks/unpack.py).
    Reports compressed bytes and the median of `repeats` runs for each.
    """
    work_dir = Path(tempfile.mkdtemp(prefix="unpack-bench-", dir=work))
    try:
        out: dict[str, Any] = {"src": str(src_dir), "repeats": repeats, **measure_unpack(src_dir, work_dir, repeats)}
        for kind, level in (("zstd", ZSTD_LEVEL), ("gzip", GZIP_LEVEL)):
            out[kind].update(level=level, seconds=out[kind].pop("unpack_s_all"), median_s=out[kind]["unpack_s"])
        out["zstd_vs_gzip_time_ratio"] = out["zstd"]["median_s"] / out["gzip"]["median_s"]
        return out
    finally:
        force_rmtree(work_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="calls per latency figure")
    parser.add_argument("--repeats", type=int, default=10, help="starts per image start figure (namespace)")
    parser.add_argument("--starts", type=int, default=20, help="starts per system in the comparison")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [8, 32, 64]
    if args.quick:
        args.n, args.repeats, args.starts, sizes = 40, 2, 3, [8]
    with tempfile.TemporaryDirectory(prefix="bsb-", dir="/tmp") as tmp:  # short: unix socket paths
        root = Path(tmp)
        root.chmod(0o755)  # the namespace backend's bwrap runs as the sandbox uid: it must reach its dirs
        tree = task_tree()
        image = build_image(tree, root / "image", dest="/work/repo").layout
        result = {"task_tree": str(tree), "start": starts(root, image, args.repeats),
                  "compare": compare(root, args.starts, args.n),
                  "unpack": unpack_benchmark(tree, repeats=5 if not args.quick else 2, work=root),
                  "concurrency": concurrency(root, sizes)}
    result["unpack"].pop("src", None)
    print(json.dumps(result))
    print(table(result["compare"]))


if __name__ == "__main__":
    main()
