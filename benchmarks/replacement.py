"""Replica death -> replacement serving the newest version, local provider: plain start vs zygote fork.

`burstrl run` (the quickstart) with `--chaos.kill_fraction 0.34 --chaos.at_step 3` (one replica of
three SIGKILLed), alternating `--fleet.zygote false` (every replica a fresh `burstrl serve`
process) and `--fleet.zygote true` (replicas forked from a zygote with the imports done) in one
run, `--rounds` times. From fleet.jsonl: the time from `replica_killed` to the replacement's
`replica_started`, which is emitted once it is registered with the router and has loaded the
newest version (benchmarks/ray_provider.py's `replacement_times`).

    .venv/bin/python benchmarks/replacement.py                  # --rounds 2 --steps 8 (~6 min)
    .venv/bin/python benchmarks/replacement.py --rounds 1       # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_provider import replacement_times, run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="", help="Model dir; default: the quickstart's warm-started tiny model.")
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="burstrl-replacement-bench-"))
    chaos = ("--chaos.kill_fraction", "0.34", "--chaos.at_step", "3")
    times: dict[str, list[float]] = {"plain": [], "zygote": []}
    for _ in range(args.rounds):
        for side, flag in (("plain", "false"), ("zygote", "true")):
            run_dir = run("local", "", out, args.steps, args.model, *chaos, "--fleet.zygote", flag)
            times[side] += replacement_times(run_dir)
    result = {"replacement_s": {k: (statistics.median(v) if v else None) for k, v in times.items()},
              "replacement_s_all": times, "steps": args.steps, "rounds": args.rounds}
    if all(times.values()):
        result["zygote_vs_plain"] = result["replacement_s"]["zygote"] / result["replacement_s"]["plain"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
