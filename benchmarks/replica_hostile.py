"""Hostile-body benchmark: a replica's latency for ordinary calls while another client sends 8 MB bodies.

Issue 36, finding 1: one oversized request used to freeze a replica for every client (its body was
tokenized, walked and rendered on the event loop before any length check). This measures what a
well-behaved client sees, with and without a hostile neighbour, side by side in one run:

- one replica, `burstrl serve` on the tiny model (`--engine.num_threads 1`), started by this script;
- the ordinary clients (this process, one keep-alive connection each): one sends small completions
  back to back (16 prompt ids, `max_tokens` 8, greedy, EOS ignored), another `GET /health` every
  50 ms; each call timed end to end;
- the hostile client (a separate process, so its uploads do not share this process's interpreter
  lock) sends, back to back, bodies just under the replica's 8 MB body limit that carry no valid
  work: ~8M digits of completions prompt text, ~4M prompt token ids, ~240k one-letter chat
  messages (in turn; `--kinds` picks), each answered with a 400;
- phases alternate `quiet` (hostile client idle, its last request finished) and `hostile`, `--rounds`
  times each; a phase ends after `--calls` ordinary calls or `--phase-s` seconds, whichever is first
  (before the fix one hostile body held the loop 3-27 s, so phases were cut by time).

Figures: p50/p99/max of the ordinary completion and health latencies per condition, hostile vs
quiet as ratios (`ratios`) and differences (`deltas_ms`; the issue's goal: health and other calls
within ~100 ms of quiet while a request is being parsed), and the hostile requests' own count,
statuses and time to their answer. Back to back is the harshest case: refusing ~20 bodies of 8 MB a
second takes about a core of the replica's (reading, counting, parsing), so on a 2-core machine the
ordinary completions also lose CPU to the attack itself, not only to waiting on the event loop.

    .venv/bin/python benchmarks/replica_hostile.py              # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/replica_hostile.py --quick      # smoke test
    # the same on other code (e.g. `git archive HEAD` unpacked in DIR): the replica child inherits it
    PYTHONPATH=DIR/src .venv/bin/python benchmarks/replica_hostile.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from burstrl.model.tiny import ensure_tiny_model
from burstrl.protocol.process import start_replica

REPO = Path(__file__).resolve().parents[1]
BODY_BYTES = 8 << 20  # the replica's default server.max_body_bytes
JSON = {"content-type": "application/json"}
ORDINARY = {"model": "base", "prompt": list(range(5, 21)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
KINDS = ("digits", "ids", "messages")
PROBE_S = 0.05  # the health prober's period


def log(msg: str) -> None:
    print(f"[bench-replica-hostile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def hostile_body(kind: str) -> tuple[str, bytes]:
    """(path, body) of one ~8 MB request that a replica must refuse: digits, token ids or messages."""
    if kind == "digits":
        head, unit, tail, path = b'{"model": "base", "max_tokens": 1, "prompt": "', b"7", b'"}', "/v1/completions"
    elif kind == "ids":
        head, unit, tail, path = b'{"model": "base", "max_tokens": 1, "prompt": [', b"5,", b"5]}", "/v1/completions"
    else:
        head, unit, tail, path = (b'{"model": "base", "max_tokens": 1, "messages": [', b'{"role":"user","content":"a"},',
                                  b'{"role":"user","content":"a"}]}', "/v1/chat/completions")
    n = (BODY_BYTES - len(head) - len(tail) - 64) // len(unit)
    return path, head + unit * n + tail


def hostile_client(url: str, kinds: list[str], active: Any, busy: Any, done: Any, results: Any) -> None:
    """The hostile process: while `active` is set, send the bodies back to back; `busy` while one is in flight."""
    bodies = [(kind, *hostile_body(kind)) for kind in kinds]
    sent: list[tuple[str, int, float]] = []
    with httpx.Client(timeout=600) as client:
        busy.clear()
        i = 0
        while not done.is_set():
            if not active.wait(0.05):
                continue
            busy.set()
            if not active.is_set():  # cleared meanwhile: the parent may already have seen us idle
                busy.clear()
                continue
            kind, path, body = bodies[i % len(bodies)]
            i += 1
            t0 = time.monotonic()
            status = client.post(url + path, content=body, headers=JSON).status_code
            sent.append((kind, status, time.monotonic() - t0))
            busy.clear()
    results.put(sent)


def run_phase(client: httpx.Client, url: str, calls: int, seconds: float) -> dict[str, list[float]]:
    """Ordinary completions back to back until `calls` of them or `seconds` have passed, while a
    second client probes /health every PROBE_S on its own connection."""
    out: dict[str, list[float]] = {"completion": [], "health": []}
    stop = threading.Event()
    probe = threading.Thread(target=probe_health, args=(url, stop, out["health"]), daemon=True)
    probe.start()
    deadline = time.monotonic() + seconds
    try:
        while len(out["completion"]) < calls and time.monotonic() < deadline:
            t0 = time.monotonic()
            client.post(url + "/v1/completions", json=ORDINARY).raise_for_status()
            out["completion"].append(time.monotonic() - t0)
    finally:
        stop.set()
        probe.join()
    return out


def probe_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """GET /health every PROBE_S (or right after the last answer, if that took longer) until `stop`."""
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            client.get(url + "/health").raise_for_status()
            latencies.append(time.monotonic() - t0)
            stop.wait(max(0.0, PROBE_S - (time.monotonic() - t0)))


def stats_ms(samples: list[float]) -> dict[str, float | int]:
    """p50, p99 (nearest rank), mean and max in milliseconds, and the sample count."""
    ordered = sorted(samples)
    n = len(ordered)

    def rank(q: float) -> float:
        return round(1000 * ordered[min(n - 1, int(q * n))], 2)

    return {"n": n, "p50": rank(0.50), "p99": rank(0.99), "mean": round(1000 * sum(ordered) / n, 2),
            "max": round(1000 * ordered[-1], 2)}


def hostile_summary(sent: list[tuple[str, int, float]]) -> dict[str, Any]:
    times = sorted(t for _, _, t in sent)
    by_kind = {k: round(max(t for kind, _, t in sent if kind == k), 3) for k in {kind for kind, _, _ in sent}}
    return {"n": len(sent), "statuses": dict(Counter(str(s) for _, s, _ in sent)),
            "answer_s_p50": round(times[len(times) // 2], 3) if times else None,
            "answer_s_max_by_kind": by_kind}


def wait_until(cond: Any, child: Any, what: str, timeout: float = 600.0) -> None:
    """Poll `cond` (1 ms) until true; RuntimeError naming `what` if the child dies or time runs out."""
    deadline = time.monotonic() + timeout
    while not cond():
        if not child.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"hostile client: not {what}")
        time.sleep(0.001)


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    active, busy, done, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    busy.set()  # until the child has built its bodies
    child = ctx.Process(target=hostile_client, args=(url, args.kinds, active, busy, done, results), daemon=True)
    child.start()
    samples: dict[str, dict[str, list[float]]] = {c: {"completion": [], "health": []} for c in ("quiet", "hostile")}
    try:
        with httpx.Client(timeout=600) as client:
            run_phase(client, url, 20, 30)  # warm: connections, first-call paths
            wait_until(lambda: not busy.is_set(), child, "the hostile client built its bodies")
            for r in range(args.rounds):
                for condition in ("quiet", "hostile"):
                    if condition == "hostile":
                        active.set()
                        wait_until(busy.is_set, child, "the first hostile body is on its way")
                    phase = run_phase(client, url, args.calls, args.phase_s)
                    active.clear()
                    wait_until(lambda: not busy.is_set(), child, "the last hostile body was answered")
                    log(f"round {r + 1} {condition}: {len(phase['completion'])} calls")
                    for key, values in phase.items():
                        samples[condition][key].extend(values)
        done.set()
        sent = results.get(timeout=600)
    finally:
        done.set()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    figures = {c: {f"{k}_ms": stats_ms(v) for k, v in samples[c].items()} for c in samples}
    figures["hostile"]["hostile_requests"] = hostile_summary(sent)
    return figures


def ratios(figures: dict[str, Any]) -> tuple[dict[str, float | None], dict[str, float]]:
    """Hostile vs quiet, p50 and p99 of each kind of ordinary call: (ratios, differences in ms)."""
    rel, diff = {}, {}
    for kind in ("completion", "health"):
        for q in ("p50", "p99"):
            quiet, hostile = figures["quiet"][f"{kind}_ms"][q], figures["hostile"][f"{kind}_ms"][q]
            rel[f"{kind}_{q}_hostile_vs_quiet"] = round(hostile / quiet, 2) if quiet else None
            diff[f"{kind}_{q}_hostile_minus_quiet"] = round(hostile - quiet, 1)
    return rel, diff


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="ordinary calls per phase (at most)")
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds per phase (at most)")
    p.add_argument("--rounds", type=int, default=2, help="quiet/hostile phase pairs")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"hostile bodies, in turn: {','.join(KINDS)}")
    p.add_argument("--quick", action="store_true", help="smoke test: 40 calls, 10 s phases, 1 round")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if set(args.kinds) - set(KINDS) or not args.kinds:
        p.error(f"--kinds takes {','.join(KINDS)}")
    if args.quick:
        args.calls, args.phase_s, args.rounds = 40, 10.0, 1
    model = ensure_tiny_model(REPO / ".cache" / "tiny-qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        replica = start_replica(model, tmp, "--engine.num_threads", "1", "--server.admin_token", "bench")
        try:
            log(f"replica at {replica.url}")
            figures = measure(replica.url, args)
        finally:
            replica.stop()
    config = {"calls_per_phase": args.calls, "phase_s": args.phase_s, "rounds": args.rounds, "kinds": args.kinds,
              "body_bytes": BODY_BYTES, "ordinary": "completions of 16 ids, max_tokens 8, greedy, back to back; GET /health every 50 ms",
              "replica": "tiny-qwen3, --engine.num_threads 1"}
    rel, diff = ratios(figures)
    print(json.dumps({"benchmark": "replica_hostile", "config": config, **figures, "ratios": rel, "deltas_ms": diff}))


if __name__ == "__main__":
    main()
