"""Weighted fair shares of a sandbox node's slots under contention (`sandbox/node_shares.py`).

One real node agent (`burstrl sandbox node --backend namespace --max-sandboxes S --tenant-weights
...`) on loopback; each tenant runs more workers than its share, and each worker loops: create a
sandbox, hold it `--hold-s`, delete it; a 429 (node full, or the tenant at its fair share while
others are owed) waits `--backoff-s` and asks again. Every `--sample-s` the sandboxes each tenant
holds (created and not yet deleted: starting ones excluded, so a tenant holds a little under what
the scheduler counts) are sampled, and averaged over the measured window (after `--warmup-s`).

Two modes, the same workload and slots: `shares` (tenant tokens, `--tenant-weights`) and the
baseline `first_come` (every worker uses the node token, which has no share: the node's slots
go to whoever asks first, so a tenant's part follows its workers, not its weight). Printed per
mode and tenant:

- `held`: time-averaged sandboxes held; `share`: slots x weight / sum of weights (all are active);
- `held_over_share`: 1.0 is exactly its weighted share;
- `jain`: Jain's fairness index of held/weight over the tenants (1.0 = perfectly weighted-fair);
- `created`, `refused_429`: its admitted and refused asks;
- `utilization`: mean live sandboxes over all tenants / slots.

    .venv/bin/python benchmarks/sandbox_shares.py             # weights a=2,b=1,c=1, 8 slots, ~100 s
    .venv/bin/python benchmarks/sandbox_shares.py --duration-s 15 --modes shares
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
from pathlib import Path

from burstrl.protocol.process import start_role
from burstrl.protocol.tenants import tenant_token
from burstrl.sandbox.node_client import NodeClient, NodeError

NODE_TOKEN = "bench-shares-node-token"
KEY = "b" * 64
SPEC = {"cpu_limit": 0.5, "memory_limit_mb": 128, "start_timeout_s": 120}


def jain(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 when all equal, 1/n when one has it all."""
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if sq else 0.0


def worker(client: NodeClient, stop: threading.Event, hold_s: float, backoff_s: float,
           tally: dict[str, int], lock: threading.Lock) -> None:
    """Create, hold, delete, repeat until `stop`; a refusal backs off and asks again."""
    while not stop.is_set():
        try:
            made = client.create(**SPEC)
        except NodeError as exc:
            with lock:
                tally["refused_429" if exc.status == 429 else "errors"] += 1
            stop.wait(backoff_s)
            continue
        with lock:
            tally["created"] += 1
            tally["held"] += 1
        stop.wait(hold_s)
        client.delete(made.id)
        with lock:
            tally["held"] -= 1


def sample(tallies: dict[str, dict[str, int]], lock: threading.Lock, stop: threading.Event, every_s: float,
           samples: list[dict[str, int]]) -> None:
    """The sandboxes each tenant holds, every `every_s`."""
    while not stop.wait(every_s):
        with lock:
            samples.append({t: tally["held"] for t, tally in tallies.items()})


def run(args: argparse.Namespace, mode: str) -> dict[str, object]:
    """One mode's measurement on a fresh agent."""
    weights = {t: float(w) for t, w in (item.split("=") for item in args.weights.split(","))}
    workers = dict(zip(weights, (int(n) for n in args.workers.split(",")), strict=True))
    tmp = Path(tempfile.mkdtemp(prefix="bench-shares-"))
    state = Path(tempfile.mkdtemp(prefix="bsh", dir="/tmp"))
    key_file = tmp / "tenant.key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    agent = start_role(["sandbox", "node", "--backend", "namespace", "--state-dir", str(state), "--cpus", "64",
                        "--memory-mb", "65536", "--name", "bench-node", "--tenant-key-file", str(key_file),
                        "--max-sandboxes", str(args.slots), "--tenant-weights", args.weights,
                        "--tenant-active-s", "10"], tmp, "node.log", timeout=120,
                       env={"BURSTRL_NODE_TOKEN": NODE_TOKEN})
    stop, lock = threading.Event(), threading.Lock()
    tallies = {t: {"created": 0, "refused_429": 0, "errors": 0, "held": 0} for t in weights}
    samples: list[dict[str, int]] = []
    token = (lambda t: tenant_token(KEY, t)) if mode == "shares" else (lambda t: NODE_TOKEN)
    threads = [threading.Thread(target=worker, args=(NodeClient(agent.url, token(t)), stop, args.hold_s,
                                                     args.backoff_s, tallies[t], lock), daemon=True)
               for t, n in workers.items() for _ in range(n)]
    try:
        for th in threads:
            th.start()
        stop.wait(args.warmup_s)
        threading.Thread(target=sample, args=(tallies, lock, stop, args.sample_s, samples), daemon=True).start()
        stop.wait(args.duration_s)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
        agent.stop()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(weights, workers, samples, {t: {k: v for k, v in tally.items() if k != "held"}
                                                 for t, tally in tallies.items()}, args)


def summarize(weights: dict[str, float], workers: dict[str, int], samples: list[dict[str, int]],
              tallies: dict[str, dict[str, int]], args: argparse.Namespace) -> dict[str, object]:
    total_w = sum(weights.values())
    held = {t: sum(s[t] for s in samples) / max(1, len(samples)) for t in weights}
    per = {t: {"weight": w, "workers": workers[t], "held": round(held[t], 2),
               "share": round(args.slots * w / total_w, 2),
               "held_over_share": round(held[t] / (args.slots * w / total_w), 3), **tallies[t]}
           for t, w in weights.items()}
    return {"slots": args.slots, "hold_s": args.hold_s, "duration_s": args.duration_s, "samples": len(samples),
            "tenants": per, "jain": round(jain([held[t] / w for t, w in weights.items()]), 4),
            "utilization": round(sum(held.values()) / args.slots, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="a=2,b=1,c=1")
    p.add_argument("--workers", default="6,10,3", help="Workers per tenant, in --weights' order (each > its share).")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--hold-s", type=float, default=2.0)
    p.add_argument("--backoff-s", type=float, default=0.2)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--duration-s", type=float, default=40.0)
    p.add_argument("--sample-s", type=float, default=0.25)
    p.add_argument("--modes", default="shares,first_come")
    args = p.parse_args()
    print(json.dumps({mode: run(args, mode) for mode in args.modes.split(",")}, indent=1))


if __name__ == "__main__":
    main()
