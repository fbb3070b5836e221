"""The router's placement rate with one hostile replica in its pool, against all healthy (issue 36).

How: one real router (`burstrl route serve`, default config but `--scrape_s`) in front of four
stand-in replicas (`burstrl.router.standin`, in a child process of their own so that their threads
do not take the GIL from the client) given with `--replicas`. One of the four is the hostile one:
in mode `healthy` it answers like the others (the baseline: four healthy replicas), in the other modes
it answers every scrape as a hostile or broken replica would; in mode `three_healthy` it answers 503 (a
dead engine: the router drops it), the pool the hostile modes should match when a hostile replica costs
the router nothing but its own place in the pool:

- `nonsense`: a live session of 10**400 tokens (before issue 36: every placement a 500);
- `nested`: `/v1/loads` nested 100k levels deep (before: the scrape loop ended);
- `drip`: a sane load answer dripped one byte a second (before: the scrape round held forever);
- `oversize`: an endless answer streamed as fast as it goes (read up to `max_scrape_bytes`, then refused;
  before issue 36 it was read to the end, i.e. forever, so that mode has no "before").

The modes take turns, `--rounds` times over, in the same run. Before each, the hostile replica answers
sanely until the router has it in rotation again (it turns hostile while in the pool); after the switch
it is scraped twice before measuring (`settle`); then `--concurrency` clients on one asyncio loop call
`POST /v1/assign` with a new session id each for `--window` seconds.

Figures: `placements_per_s`, the 200 answers per second (median over the rounds); `ratio_vs_healthy`
and `ratio_vs_three_healthy`, divided by those modes' rates from the same run (a smaller pool is itself
faster to place on: each placement scans every eligible replica); `errors`, answers other than 200 and
broken connections, and `on_hostile`, placements on the hostile replica (both over all rounds);
`unsettled`, windows measured without the two scrapes within `--settle_s` (a router whose scrape loop
ended or hangs). The machine is shared: the interleaving, not the absolute rate, makes the ratios fair;
the stand-ins run on it too, so in `oversize` part of the cost is the hostile stand-in's own CPU (it
streams as fast as the router reads). `--pythonpath SRC` runs the router from another source tree (the
commit before the fix, exported with `git archive`) for a before/after.

    .venv/bin/python benchmarks/router_hostile.py                # ~2 min on 2 busy cores
    .venv/bin/python benchmarks/router_hostile.py --rounds 1 --window 2

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection

import httpx

from burstrl.protocol.process import start_router
from burstrl.router.standin import Answer, StandInReplica

MODES = ("healthy", "three_healthy", "nonsense", "nested", "drip", "oversize")
TOKEN = "bench-token"


def hostile_answer(mode: str) -> Answer | None:
    """What the hostile replica answers to scrapes in `mode` (None: sane)."""
    sane = {"num_used_tokens": 0, "max_total_num_tokens": 100_000, "versions": ["base"], "sessions": []}
    if mode == "three_healthy":  # its engine is dead: dropped, and left out until it answers again
        return Answer(status=503, body=b'{"error": {"message": "engine is not running", "code": 503}}')
    if mode == "nonsense":
        return Answer(body=json.dumps({**sane, "sessions": [{"session_id": "huge", "tokens": 10**400}]}).encode())
    if mode == "nested":
        return Answer(body=b"[" * 100_000)
    if mode == "drip":
        return Answer(body=json.dumps(sane).encode(), chunk_bytes=1, pause_s=1.0)
    if mode == "oversize":
        return Answer(body=lambda: iter(lambda: b" " * (1 << 20), None))  # endless
    return None


def fleet(conn: Connection, n: int) -> None:
    """Child process: `n` stand-ins (the last is the hostile one), driven over `conn`."""
    replicas = [StandInReplica() for _ in range(n)]
    conn.send([r.url for r in replicas])
    while True:
        cmd, arg = conn.recv()
        if cmd == "mode":
            replicas[-1].scrape = hostile_answer(arg)
            conn.send(None)
        elif cmd == "scrapes":
            conn.send(replicas[-1].counts["loads"])
        else:
            for r in replicas:
                r.close()
            conn.send(None)
            return


def ask(conn: Connection, cmd: str, arg: object = None) -> object:
    conn.send((cmd, arg))
    return conn.recv()


async def measure(url: str, window: float, concurrency: int, hostile: str, tag: str) -> dict:
    """Placements answered 200 per second over `window`, errors, and placements on `hostile`."""
    counts = {"ok": 0, "errors": 0, "on_hostile": 0}
    stop = time.perf_counter() + window
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker(w: int) -> None:
            i = 0
            while time.perf_counter() < stop:
                i += 1
                try:
                    r = await client.post(url + "/v1/assign", json={"session_id": f"{tag}-{w}-{i}", "version": "base"})
                except httpx.HTTPError:  # a connection the router closed after a 500
                    counts["errors"] += 1
                    continue
                if r.status_code != 200:
                    counts["errors"] += 1
                    continue
                counts["ok"] += 1
                counts["on_hostile"] += r.json()["url"] == hostile

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {**counts, "rate": counts["ok"] / elapsed}


def settle(conn: Connection, timeout: float) -> bool:
    """Until the hostile replica has been scraped twice more (the router has seen its new answers);
    False if that did not happen within `timeout` (a router whose scrapes stopped or hang)."""
    start, deadline = ask(conn, "scrapes"), time.monotonic() + timeout
    while ask(conn, "scrapes") < start + 2:  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def in_rotation(router: str, hostile: str, timeout: float) -> None:
    """Until the router lists the hostile replica as healthy (it answers sanely now)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = httpx.get(router + "/v1/replicas", timeout=30).json()["replicas"]
        if any(r["url"] == hostile and r["healthy"] for r in listed):
            return
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=fleet, args=(child, args.replicas), daemon=True)
    proc.start()
    urls: list[str] = parent.recv()
    env_path = os.environ.get("PYTHONPATH")
    if args.pythonpath:
        os.environ["PYTHONPATH"] = args.pythonpath  # the router child's source tree
    router = start_router(tempfile.mkdtemp(prefix="router-hostile-"), "--cluster_token", TOKEN,
                          "--replicas", json.dumps(urls), "--scrape_s", str(args.scrape_s))
    if args.pythonpath:
        os.environ.pop("PYTHONPATH") if env_path is None else os.environ.__setitem__("PYTHONPATH", env_path)
    per_mode: dict[str, list[dict]] = {m: [] for m in args.modes}
    try:
        for r in range(args.rounds):
            for mode in args.modes:
                ask(parent, "mode", "healthy")
                in_rotation(router.url, urls[-1], args.settle_s)
                ask(parent, "mode", mode)
                settled = settle(parent, args.settle_s)
                figures = asyncio.run(measure(router.url, args.window, args.concurrency, urls[-1], f"{mode}-{r}"))
                per_mode[mode].append({**figures, "unsettled": not settled})
        ask(parent, "mode", "healthy")
    finally:
        router.stop()
        ask(parent, "stop")
        proc.join(10)
    rates = {m: statistics.median(x["rate"] for x in runs) for m, runs in per_mode.items()}

    def ratios(baseline: str) -> dict[str, float] | None:
        base = rates.get(baseline)
        return {m: round(v / base, 3) for m, v in rates.items()} if base else None
    return {"benchmark": "router_hostile", "router_src": args.pythonpath or "this tree", "replicas": args.replicas,
            "scrape_s": args.scrape_s, "rounds": args.rounds, "window_s": args.window,
            "concurrency": args.concurrency,
            "placements_per_s": {m: round(v, 1) for m, v in rates.items()},
            "ratio_vs_healthy": ratios("healthy"), "ratio_vs_three_healthy": ratios("three_healthy"),
            "errors": {m: sum(x["errors"] for x in runs) for m, runs in per_mode.items()},
            "on_hostile": {m: sum(x["on_hostile"] for x in runs) for m, runs in per_mode.items()},
            "unsettled": {m: sum(x["unsettled"] for x in runs) for m, runs in per_mode.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=4.0, help="seconds of placements per mode and round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--replicas", type=int, default=4, help="stand-ins, the hostile one included")
    p.add_argument("--scrape_s", type=float, default=0.5)
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--settle_s", type=float, default=30.0, help="longest wait for two scrapes after a switch")
    p.add_argument("--pythonpath", default="", help="run the router from this source tree (a before/after)")
    print(json.dumps(run(p.parse_args())), flush=True)


if __name__ == "__main__":
    main()
