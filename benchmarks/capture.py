"""Capture benchmark: in-replica capture against a capture proxy, over an injected network delay.

A burstrl replica records every call of a session itself, so after a rollout the orchestrator
fetches the whole trajectory with one `GET /v1/traces/{sid}`. The baseline is what systems without
in-replica capture do: a capture proxy in the OpenAI path (`benchmarks/capture_proxy.py`) that
asks the server for token ids and logprobs on every call, records them, and strips them from the
answer. The orchestrator <-> replica link gets a one-way delay from `benchmarks/netdelay.py` (a
loopback relay standing in for `tc netem`), and every configuration pays that same delay:

- `in_replica`:          client -> delay -> replica            (calls + 1 trace fetch over the delay)
- `proxy_client_side`:   client -> proxy -> delay -> replica   (the harness-side proxy; fetch is local)
- `proxy_replica_side`:  client -> delay -> proxy -> replica   (proxy beside the replica)

Workload: R multi-turn chat rollouts of `--calls` calls each; every call resends the conversation
(previous reply + a short new user message), `max_tokens` 4, temperature 1 with a per-call seed,
so the same rollout index samples the same tokens in every configuration (`captures_match`).
One replica serves all configurations (`--engine.num_threads 1`, cross-session prefix sharing
off, so a rollout repeated by the next configuration does not reuse the previous one's cache);
configurations are interleaved in a rotating order within each delay to cancel drift.
Rollout wall time = first call sent -> trajectory in hand (calls + trace fetch); releasing the
sessions afterwards is not timed in any configuration. Bytes = what crossed the delayed link.

    .venv/bin/python benchmarks/capture.py                        # --delays-ms 0,5,20 --calls 100 --rollouts 4
    .venv/bin/python benchmarks/capture.py --quick                # smoke test, ~30-60 s
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from burstrl.model.tiny import ensure_tiny_model
from burstrl.protocol.process import ready_url, start_replica

sys.path.insert(0, str(Path(__file__).parent))
from netdelay import DelayRelay

REPO = Path(__file__).resolve().parent.parent
ADMIN = "bench-admin-token"
CONFIGS = ("in_replica", "proxy_client_side", "proxy_replica_side")
MAX_TOKENS = 4
SYSTEM = "You are terse."


@dataclass
class Route:
    """How one configuration reaches the replica: the client's base URL and the delayed link."""

    name: str
    base: str  # where the client sends calls and fetches the trace
    relay: DelayRelay  # the delayed link this configuration crosses
    replica: str  # the replica itself, to release the session (untimed)
    client: httpx.Client


@dataclass
class Result:
    wall_s: float
    calls: list[dict]
    bytes_up: int
    bytes_down: int
    stripped: bool  # the client's answers carried no token ids / logprobs it did not ask for


@dataclass
class Child:
    """A child server process (replica or proxy); `stop()` ends its process group."""

    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_child(cmd: list[str], log: Path) -> Child:
    """Run `cmd` in its own process group; return once it prints its JSON ready line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    child = Child("", proc)
    for line in proc.stdout:  # ends ("") if the child dies; its log says why
        url = ready_url(line)
        if url is not None:
            child.url = url
            return child
    child.stop()
    raise RuntimeError(f"{cmd[1:3]} did not start; log {log}:\n{log.read_text()[-2000:]}")


def start_proxy(upstream: str, workdir: Path) -> Child:
    """`benchmarks/capture_proxy.py` in front of `upstream`."""
    cmd = [sys.executable, str(Path(__file__).parent / "capture_proxy.py"), "--upstream", upstream]
    return start_child(cmd, workdir / "proxy.log")


def start_bench_replica(workdir: Path) -> Any:
    """`burstrl serve` on the tiny model, prefix sharing off (a repeated rollout must not reuse a cache)."""
    model = ensure_tiny_model(REPO / ".cache" / "tiny-qwen3")
    overrides = ["--server.admin_token", ADMIN, "--engine.num_threads", "1", "--engine.prefix_sharing", "false"]
    return start_replica(model, workdir, *overrides)


def relay_to(url: str) -> DelayRelay:
    parsed = urlparse(url)
    return DelayRelay(parsed.hostname or "127.0.0.1", parsed.port or 80).start()


def run_rollout(route: Route, sid: str, seed: int, calls: int) -> Result:
    """One multi-turn session, then one trace fetch; wall time covers both."""
    route.relay.reset_counters()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "turn 0"}]
    stripped = True
    t0 = time.perf_counter()
    for i in range(calls):
        body = {"model": "base", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 1.0,
                "seed": seed * 1000 + i, "session_id": sid}
        r = route.client.post(route.base + "/v1/chat/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        stripped &= "token_ids" not in choice and choice.get("logprobs") is None
        messages = messages + [{"role": "assistant", "content": choice["message"]["content"]},
                               {"role": "user", "content": f"turn {i + 1}"}]
    trace = route.client.get(route.base + f"/v1/traces/{sid}")
    trace.raise_for_status()
    wall = time.perf_counter() - t0
    result = Result(wall, trace.json()["calls"], route.relay.bytes_up, route.relay.bytes_down, stripped)
    release(route, sid)
    return result


def release(route: Route, sid: str) -> None:
    """Free the session everywhere it is held (not timed: no configuration waits for it)."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    if route.name != "in_replica":
        route.client.delete(route.base + f"/v1/traces/{sid}").raise_for_status()
    route.client.delete(route.replica + f"/v1/traces/{sid}", headers=admin).raise_for_status()


def same_capture(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    """Identical prompt/completion ids on every call; and the largest logprob difference."""
    ids = len(a) == len(b) and all(x["prompt_ids"] == y["prompt_ids"] and x["completion_ids"] == y["completion_ids"]
                                   for x, y in zip(a, b, strict=False))
    diff = max((abs(p - q) for x, y in zip(a, b, strict=False) for p, q in zip(x["logprobs"], y["logprobs"], strict=False)), default=0.0)
    lengths = all(len(x["logprobs"]) == len(x["completion_ids"]) for x in a + b)
    return ids and lengths, diff


def measure_delay(routes: dict[str, Route], relays: list[DelayRelay], delay_ms: float, rollouts: int,
                  calls: int, seed: int) -> dict:
    """R rollouts per configuration at one delay, in a rotating order (ABC, BCA, CAB, ...)."""
    for relay in relays:
        relay.delay_s = delay_ms / 1000
    results: dict[str, list[Result]] = {name: [] for name in CONFIGS}
    for r in range(rollouts):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for name in order:
            results[name].append(run_rollout(routes[name], f"{name}-d{delay_ms:g}-r{r}", seed + r, calls))
        print(f"delay {delay_ms:g} ms rollout {r}: " + ", ".join(
            f"{n} {results[n][-1].wall_s:.2f}s" for n in CONFIGS), file=sys.stderr)
    return summarize(results, calls)


def summarize(results: dict[str, list[Result]], calls: int) -> dict:
    figures = {}
    for name, rs in results.items():
        walls = [x.wall_s for x in rs]
        figures[name] = {
            "mean_rollout_s": statistics.mean(walls), "median_rollout_s": statistics.median(walls),
            "stdev_rollout_s": statistics.stdev(walls) if len(walls) > 1 else 0.0,
            "ms_per_call": 1000 * statistics.mean(walls) / calls,
            "wire_bytes_per_call_up": statistics.mean(x.bytes_up for x in rs) / calls,
            "wire_bytes_per_call_down": statistics.mean(x.bytes_down for x in rs) / calls,
            "captured_calls": [len(x.calls) for x in rs], "client_answers_plain": all(x.stripped for x in rs)}
    base = figures["in_replica"]
    ratios = {name: {"rollout_time": figures[name]["mean_rollout_s"] / base["mean_rollout_s"],
                     "wire_bytes": ((figures[name]["wire_bytes_per_call_up"] + figures[name]["wire_bytes_per_call_down"])
                                    / (base["wire_bytes_per_call_up"] + base["wire_bytes_per_call_down"]))}
              for name in CONFIGS if name != "in_replica"}
    match, diff = True, 0.0
    for name in CONFIGS[1:]:
        for a, b in zip(results["in_replica"], results[name], strict=False):
            ok, d = same_capture(a.calls, b.calls)
            match &= ok and len(a.calls) == calls
            diff = max(diff, d)
    return {"figures": figures, "proxy_vs_in_replica": ratios, "captures_match": match,
            "max_logprob_diff": diff}


def setup(root: Path) -> tuple[Any, list[Child], list[DelayRelay], dict[str, Route]]:
    """One replica; a relay in front of it; a proxy on each side of the delay.

    If any part fails to start, the parts already running are stopped before the error propagates.
    """
    started: list[Any] = []
    try:
        replica = start_bench_replica(root / "replica")
        started.append(replica)
        relay_replica = relay_to(replica.url)
        started.append(relay_replica)
        proxy_client = start_proxy(relay_replica.url, root / "proxy_client")  # pays the delay per call
        started.append(proxy_client)
        proxy_replica = start_proxy(replica.url, root / "proxy_replica")  # beside the replica
        started.append(proxy_replica)
        relay_proxy = relay_to(proxy_replica.url)
    except BaseException:
        for part in reversed(started):
            part.stop()
        raise
    bases = {"in_replica": (relay_replica.url, relay_replica), "proxy_client_side": (proxy_client.url, relay_replica),
             "proxy_replica_side": (relay_proxy.url, relay_proxy)}
    routes = {name: Route(name, base, relay, replica.url, httpx.Client(timeout=300))
              for name, (base, relay) in bases.items()}
    return replica, [proxy_client, proxy_replica], [relay_replica, relay_proxy], routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays-ms", default="0,5,20", help="one-way delays, comma-separated")
    parser.add_argument("--calls", type=int, default=100, help="calls per rollout")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per configuration and delay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: delays 0,5, 30 calls, 2 rollouts")
    args = parser.parse_args()
    if args.quick:
        args.delays_ms, args.calls, args.rollouts = "0,5", 30, 2
    delays = [float(d) for d in args.delays_ms.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        replica, proxies, relays, routes = setup(Path(tmp))
        try:
            for name in CONFIGS:  # warm every path (connections, first-call compile) before timing
                run_rollout(routes[name], f"warmup-{name}", 10_000, 5)
            per_delay = {f"{d:g}ms": measure_delay(routes, relays, d, args.rollouts, args.calls, args.seed)
                         for d in delays}
        finally:
            for route in routes.values():
                route.client.close()
            for relay in relays:
                relay.stop()
            for p in (*proxies, replica):
                p.stop()
    config = {"delays_ms": delays, "calls": args.calls, "rollouts": args.rollouts, "max_tokens": MAX_TOKENS,
              "seed": args.seed, "replica": "tiny-qwen3, --engine.num_threads 1, prefix_sharing off",
              "proxy_placements": ["proxy_client_side: client -> proxy -> delay -> replica",
                                   "proxy_replica_side: client -> delay -> proxy -> replica"],
              "delay": "one-way, each direction, loopback relay (benchmarks/netdelay.py), not netem"}
    print(json.dumps({"benchmark": "capture", "config": config, "per_delay": per_delay}))


if __name__ == "__main__":
    main()
