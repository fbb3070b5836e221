"""Replica death -> replacement serving the newest version: plain start vs zygote fork, local or Ray.

`burstrl run` (the quickstart) with `--chaos.kill_fraction 0.34 --chaos.at_step 3` (one replica of
three SIGKILLed), alternating `--fleet.zygote false` (every replica a fresh `burstrl serve`
process) and `--fleet.zygote true` (replicas forked from a zygote with the imports done: one per
run locally, one per node on Ray) in one run, `--rounds` times. From fleet.jsonl: the time from
`replica_killed` to the replacement's `replica_started`, which is emitted once it is registered
with the router and has loaded the newest version (benchmarks/ray_provider.py's
`replacement_times`).

With `--provider ray` (one local Ray instance started here serves every run) each replacement is
also split into phases from the provider's logs/ray_starts.jsonl: kill -> the new actor asked
for, actor placed (a worker started and answering), process started or forked -> ready, and ready
-> registered and serving the newest version.

    .venv/bin/python benchmarks/replacement.py                  # local, --rounds 2 --steps 8 (~6 min)
    .venv/bin/python benchmarks/replacement.py --provider ray   # the same on a local Ray instance
    .venv/bin/python benchmarks/replacement.py --rounds 1       # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_provider import local_ray, replacement_times, rows, run  # noqa: E402

PHASES = ("to_actor_s", "placed_s", "ready_s", "register_s")


def replacement_phases(run_dir: Path) -> list[dict[str, float]]:
    """Each replacement's time split: kill -> actor asked (`to_actor_s`), -> placed (`placed_s`),
    -> process ready (`ready_s`), -> registered and serving the newest version (`register_s`)."""
    events = [e for e in rows(run_dir / "fleet.jsonl") if e.get("kind") == "event"]
    killed = {e["replica"]: e["t"] for e in events if e["event"] == "replica_killed"}
    starts = {s["name"]: s for s in rows(run_dir / "logs" / "ray_starts.jsonl")}
    out = []
    for e in events:
        if e["event"] != "replica_started" or "(replaces " not in e["detail"]:
            continue
        dead = e["detail"].split("(replaces ")[1].rstrip(")")
        start = starts.get(e["replica"])
        if dead not in killed or start is None:
            continue
        ready_at = start["t"] + start["placed_s"] + start["ready_s"]
        out.append({"to_actor_s": start["t"] - killed[dead], "placed_s": start["placed_s"],
                    "ready_s": start["ready_s"], "register_s": e["t"] - ready_at, "how": start["how"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--provider", choices=("local", "ray"), default="local")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="", help="Model dir; default: the quickstart's warm-started tiny model.")
    args = p.parse_args()
    address = local_ray() if args.provider == "ray" else ""
    out = Path(tempfile.mkdtemp(prefix="burstrl-replacement-bench-"))
    chaos = ("--chaos.kill_fraction", "0.34", "--chaos.at_step", "3")
    times: dict[str, list[float]] = {"plain": [], "zygote": []}
    phases: dict[str, list[dict]] = {"plain": [], "zygote": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for side, flag in (("plain", "false"), ("zygote", "true")):
            run_dir = run(args.provider, address, out, args.steps, args.model, *chaos, "--fleet.zygote", flag)
            times[side] += replacement_times(run_dir)
            if args.provider == "ray":
                phases[side] += replacement_phases(run_dir)
            load.append(os.getloadavg()[0])
    result = {"provider": args.provider, "replacement_s": {k: (statistics.median(v) if v else None)
                                                         for k, v in times.items()},
              "replacement_s_all": times, "steps": args.steps, "rounds": args.rounds,
              "load_1min": [round(x, 1) for x in load]}
    if all(times.values()):
        result["zygote_vs_plain"] = result["replacement_s"]["zygote"] / result["replacement_s"]["plain"]
    if args.provider == "ray":
        result["phases_median_s"] = {side: {k: round(statistics.median(r[k] for r in v), 3) for k in PHASES}
                                     for side, v in phases.items() if v}
        result["phases_all"] = phases
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
