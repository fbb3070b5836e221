"""Sandboxes: start time (image cached vs not), command latency vs bare and vs SWE-ReX, zstd vs gzip, concurrency.

All figures come from one invocation on this machine:
- start: `NamespaceBackend.create` -> first `exec("true")` answered, with an image built from a
  task-like tree (a copy of an installed package, ~17 MB) whose layers are (a) already in the node
  cache or (b) not (a fresh cache each time: unpack + merge + the sandbox's writable /work copy),
  and with no image (the host's system dirs read-only). Goal on a hit: <= 0.3 s.
- command latency of `true`: bare `subprocess.run` on the host (the floor), burstrl's sandboxd on
  the host (unix socket, keep-alive), the same inside a sandbox, and SWE-ReX's `swerex-remote`
  (one-shot `/execute` and a command in its bash session), p50/p99 over `--n` calls; ready time
  of both daemons from process start. Goal: burstrl p50 <= 3x bare, and ahead of SWE-ReX on each.
- the same layer unpacked as tar+zstd vs tar+gzip, end to end.
- N sandboxes started at once (8, 32, 64): start p50/p99 and failures (goal: 0).

    .venv/bin/python benchmarks/sandbox.py            # ~2-3 min
    .venv/bin/python benchmarks/sandbox.py --quick    # fewer repetitions, N = 8 only
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from burstrl.sandbox.backends import SandboxSpec, make_backend  # noqa: E402
from burstrl.sandbox.client import SandboxClient  # noqa: E402
from burstrl.sandbox.images import build_image  # noqa: E402
from burstrl.sandbox.layercache import LayerCache, unpack_benchmark  # noqa: E402


def percentiles(ms: list[float]) -> dict[str, float]:
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
    t0 = time.perf_counter()
    sb = backend.create(spec)
    try:
        assert sb.exec("true").exit_code == 0
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


def host_daemon(root: Path) -> tuple[subprocess.Popen, str, str, float]:
    """burstrl's daemon on the host (no sandbox): (process, socket, token, seconds to its ready line)."""
    token = "bench-token"
    (root / "token").write_text(token)
    sock = str(root / "d.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "burstrl.sandbox.daemon", "--socket", sock, "--token-file",
                             str(root / "token")], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    line = proc.stdout.readline()
    ready = time.perf_counter() - t0
    assert json.loads(line)["event"] == "ready", line
    return proc, sock, token, ready


def timed_ms(call, n: int) -> list[float]:
    """Milliseconds of each of `n` calls of `call()`."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append((time.perf_counter() - t) * 1000)
    return out


def latencies(root: Path, n: int) -> dict:
    bare = timed_ms(lambda: subprocess.run(["true"], check=True), n)
    readies = []
    for i in range(5):
        proc, *_, ready = host_daemon(root)
        readies.append(ready)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc, sock, token, _ = host_daemon(root)
    try:
        with SandboxClient(socket_path=sock, token=token) as c:
            c.exec(["true"])
            host = timed_ms(lambda: c.exec(["true"]), n)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    backend = make_backend("namespace", state_dir=root / "s")
    sb = backend.create(SandboxSpec())
    try:
        sb.exec(["true"])
        inside = timed_ms(lambda: sb.exec(["true"]), n)
    finally:
        sb.close()
    from swerex_side import measure

    swerex = measure(n)
    out = {"bare_ms": percentiles(bare), "sandboxd_host_ms": percentiles(host), "sandboxd_in_sandbox_ms":
           percentiles(inside), "sandboxd_ready_s_median": round(statistics.median(readies), 4), "swerex": swerex}
    out["ratio_p50_vs_bare"] = round(out["sandboxd_host_ms"]["p50"] / out["bare_ms"]["p50"], 2)
    out["ratio_p99_vs_bare"] = round(out["sandboxd_host_ms"]["p99"] / out["bare_ms"]["p99"], 2)
    out["in_sandbox_ratio_p50_vs_bare"] = round(out["sandboxd_in_sandbox_ms"]["p50"] / out["bare_ms"]["p50"], 2)
    out["swerex_one_shot_p50_vs_sandboxd"] = round(swerex["one_shot_ms"]["p50"] / out["sandboxd_host_ms"]["p50"], 2)
    return out


def concurrency(root: Path, sizes: list[int]) -> dict:
    """N sandboxes asked for at once (one thread each): per-sandbox start time and failures."""
    out = {}
    for n in sizes:
        backend = make_backend("namespace", state_dir=root / f"c{n}")

        def one(_: int) -> float | str:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="calls per latency figure")
    parser.add_argument("--repeats", type=int, default=10, help="starts per start figure")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [8, 32, 64]
    if args.quick:
        args.n, args.repeats, sizes = 100, 3, [8]
    with tempfile.TemporaryDirectory(prefix="bsb-", dir="/tmp") as tmp:  # short: unix socket paths
        root = Path(tmp)
        tree = task_tree()
        image = build_image(tree, root / "image", dest="/work/repo").layout
        result = {"task_tree": str(tree), "start": starts(root, image, args.repeats),
                  "latency": latencies(root, args.n),
                  "unpack": unpack_benchmark(tree, repeats=5 if not args.quick else 2, work=root),
                  "concurrency": concurrency(root, sizes)}
    result["unpack"].pop("src", None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
