"""Sandbox cluster benchmark, live: real node agents, real sandboxes, through `ClusterPool`.

1. Scale: `--sandboxes` sandboxes started at once (8 creating threads) across the nodes and held
   together; sandboxes started per second, the spread over nodes, placement decision latency, and a
   command run in every one of them. Nodes are `--nodes` loopback agents (`burstrl sandbox node`,
   each its own state dir and layer cache), or with `--ray` agents started by the Ray launcher code
   (`providers/ray_sandbox.py`) on a local `ray.cluster_utils.Cluster` with `--nodes` sandbox nodes.
2. Image cache: the same stream of sandbox requests over `--images` images (Zipf-weighted), at most
   `--window` alive at once, placed by `ours` and by a random admitting node, each on fresh loopback
   agents whose layer caches hold about `--cache-images` images. The hit rate is the agents' own
   layer cache counters (hits / (hits + misses)) over the stream, so it is what the nodes did.

Both policies in one run, same client code, same stream. This machine has 2 cores shared with other
work: absolute rates are low and noisy; the ratio of hit rates is the figure that carries.

    PYTHONPATH=src .venv/bin/python benchmarks/sandbox_cluster.py                 # loopback agents
    PYTHONPATH=src .venv/bin/python benchmarks/sandbox_cluster.py --ray --skip-cache
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from burstrl.protocol.process import RoleProcess, start_role
from burstrl.sandbox.backends import SandboxSpec
from burstrl.sandbox.cluster import ClusterPool, NodeRef
from burstrl.sandbox.node_client import NodeClient
from burstrl.sandbox.placement import NodeState, ReferencePolicy, SandboxRequest

TOKEN = "bench-token"


@dataclass
class RandomPolicy(ReferencePolicy):
    """A random node among those that admit the sandbox (the reference's requests): no image affinity."""

    seed: int = 0
    name: str = "random"
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.rng.seed(self.seed)

    def choose(self, nodes: Sequence[NodeState], request: SandboxRequest) -> NodeState | None:
        ok = [n for n in nodes if self.evaluate(n, request) is not None]
        return self.rng.choice(ok) if ok else None


@contextmanager
def loopback_agents(root: Path, n: int, cpus: float, memory_mb: int, cache_gb: float) -> Iterator[list[NodeRef]]:
    states = [Path(tempfile.mkdtemp(prefix=f"sbb{i}", dir="/tmp")) for i in range(n)]
    procs: list[RoleProcess] = []
    try:
        for i, state in enumerate(states):
            procs.append(start_role(
                ["sandbox", "node", "--backend", "namespace", "--state-dir", str(state), "--layer-cache",
                 str(root / f"cache{i}"), "--cache-gb", f"{cache_gb:.9f}", "--cpus", str(cpus),
                 "--memory-mb", str(memory_mb), "--name", f"node{i}"], root / f"agent{i}", "node.log",
                timeout=120, env={"BURSTRL_NODE_TOKEN": TOKEN}))
        yield [NodeRef(p.url, TOKEN, f"node{i}") for i, p in enumerate(procs)]
    finally:
        for p in procs:
            p.stop()
        for s in states:
            shutil.rmtree(s, ignore_errors=True)


@contextmanager
def ray_agents(root: Path, n: int, cpus: float, memory_mb: int) -> Iterator[list[NodeRef]]:
    import ray
    from ray.cluster_utils import Cluster

    from burstrl.providers.ray_sandbox import SandboxAgents
    from burstrl.sandbox.cluster import load_nodes

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": 80 << 20})
    agents = None
    try:
        ray.init(address=cluster.address, namespace="sandbox-bench", log_to_driver=False)
        for _ in range(n):
            cluster.add_node(num_cpus=int(cpus), memory=memory_mb << 20, resources={"sandbox_node": 1},
                             object_store_memory=80 << 20)
        cluster.wait_for_nodes()
        agents = SandboxAgents(root, root / "logs", {}, backend="namespace", timeout_s=300)
        path = agents.start()
        assert path is not None
        yield load_nodes(path)
    finally:
        if agents is not None:
            agents.stop()
        ray.shutdown()
        cluster.shutdown()


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


def scale(refs: list[NodeRef], n: int) -> dict[str, Any]:
    """`n` sandboxes started at once and held together; a command in each."""
    pool = ClusterPool(refs, "ours", max_concurrent=n, refresh_s=0.5)
    try:
        spec = SandboxSpec(cpu_limit=1, memory_limit_mb=1024, start_timeout_s=600)
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as ex:
            boxes = list(ex.map(lambda _: pool.create(spec, timeout=1800), range(n)))
        wall = time.monotonic() - t0
        with ThreadPoolExecutor(8) as ex:
            ok = sum(ex.map(lambda sb: sb.exec(f"echo {sb.id}", timeout=300).stdout == f"{sb.id}\n", boxes))
        t1 = time.monotonic()
        pool.close_all()
        return {"sandboxes": n, "held_at_once": len(boxes), "commands_ok": ok, "start_wall_s": round(wall, 1),
                "started_per_s": round(n / wall, 2), "close_all_s": round(time.monotonic() - t1, 1),
                "by_node": dict(Counter(sb.node for sb in boxes)),
                "decision_us": {"p50": round(pct(pool.decision_s, 0.5) * 1e6), "p99": round(pct(pool.decision_s, 0.99) * 1e6),
                                "n": len(pool.decision_s)}}
    finally:
        pool.close()


def make_images(root: Path, k: int, layer_kb: int) -> list[Path]:
    """`k` images, one incompressible layer of `layer_kb` KB each (so cache size counts images)."""
    from burstrl.sandbox.images import build_image

    out = []
    for i in range(k):
        src = root / f"src{i}"
        src.mkdir(parents=True, exist_ok=True)
        (src / "blob").write_bytes(random.Random(i).randbytes(layer_kb << 10))
        build_image(src, root / f"image{i}")
        out.append(root / f"image{i}")
    return out


def stream(k: int, length: int, seed: int) -> list[int]:
    """Image indices, Zipf-weighted (a few images are common, most are rare), same for every policy."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(k)]
    return rng.choices(range(k), weights=weights, k=length)


def cache_run(root: Path, policy: Any, images: list[Path], order: list[int], args: argparse.Namespace) -> dict[str, Any]:
    cache_gb = args.cache_images * (args.layer_kb << 10) * 1.05 / 1e9
    with loopback_agents(root, args.nodes, 8, 16384, cache_gb) as refs:
        pool = ClusterPool(refs, policy, max_concurrent=args.window, refresh_s=0.25)
        live: list[Any] = []
        starts = []
        try:
            for i in order:
                if len(live) >= args.window:
                    live.pop(0).close()
                pool.refresh()  # the reports show what the last start cached, as a steady stream would
                t0 = time.monotonic()
                live.append(pool.create(SandboxSpec(image=images[i], cpu_limit=1, memory_limit_mb=512,
                                                    start_timeout_s=300), timeout=600))
                starts.append(time.monotonic() - t0)
            for sb in live:
                sb.close()
            counts = [NodeClient(r.url, TOKEN).report()["layer_cache"] for r in refs]
        finally:
            pool.close()
    hits, misses = sum(c["hits"] for c in counts), sum(c["misses"] for c in counts)
    return {"policy": policy if isinstance(policy, str) else policy.name, "starts": len(order),
            "layer_hits": hits, "layer_misses": misses, "hit_rate": round(hits / max(hits + misses, 1), 3),
            "start_p50_s": round(pct(starts, 0.5), 3), "start_p99_s": round(pct(starts, 0.99), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--sandboxes", type=int, default=64)
    parser.add_argument("--ray", action="store_true", help="agents on a local ray.cluster_utils.Cluster")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--skip-cache", action="store_true")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--stream", type=int, default=60)
    parser.add_argument("--window", type=int, default=6)
    parser.add_argument("--cache-images", type=int, default=2, help="images each node's layer cache holds")
    parser.add_argument("--layer-kb", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sandbox-cluster-bench-"))
    out: dict[str, Any] = {"args": vars(args), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    try:
        if not args.skip_scale:
            agents = ray_agents if args.ray else (lambda r, n, c, m: loopback_agents(r, n, c, m, 20.0))
            with agents(root / "scale", args.nodes, 32, 32768) as refs:
                out["scale"] = scale(refs, args.sandboxes)
            print(json.dumps(out["scale"]), flush=True)
        if not args.skip_cache:
            images = make_images(root / "images", args.images, args.layer_kb)
            order = stream(args.images, args.stream, args.seed)
            out["cache"] = [cache_run(root / f"cache-{i}", policy, images, order, args)
                            for i, policy in enumerate(("ours", RandomPolicy(seed=args.seed)))]
            for row in out["cache"]:
                print(json.dumps(row), flush=True)
        out["loadavg_end"] = os.getloadavg()
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
