"""Sandbox start and `true` latency of this tree beside an earlier one, per backend (issue 49: the
daemon marks its fds close-on-exec before each spawn and hands commands an env built from JSON).

Each tree runs in a worker process of its own (both are the package `burstrl`), and the workers
alternate round by round on each backend, so the machine's noise falls on both alike. A round:
`--starts` sandboxes started (create -> first `true` answered) and, on one of them, `--calls`
`true` execs through the same keep-alive client as benchmarks/sandbox.py. Figures: medians over
all rounds; ratio = this tree / the before tree.

    .venv/bin/python benchmarks/sandbox_spawn.py --before 8178664   # ~2 min
    .venv/bin/python benchmarks/sandbox_spawn.py --before-dir /tmp/tree   # a tree already checked out

Prints one JSON object, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ["namespace", "oci-runc", "oci-runsc"]

# One round on one backend, run with PYTHONPATH=<tree>/src: prints {"start_ms": [...], "true_ms": [...]}.
WORKER = r"""
import json, shutil, sys, tempfile, time, warnings
from pathlib import Path
sys.path.insert(0, BENCH)
warnings.simplefilter("ignore")
from sandbox_client import burstrl_client, burstrl_exec_true
from burstrl.sandbox.backends import SandboxSpec, make_backend
state = Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp"))
if KIND == "namespace":
    backend = make_backend("namespace", state_dir=state)
else:
    backend = make_backend("oci", state_dir=state, runtime=KIND.removeprefix("oci-"))
out = {"start_ms": [], "true_ms": []}
for i in range(STARTS):
    t0 = time.perf_counter()
    sb = backend.create(SandboxSpec())
    try:
        with burstrl_client(sb.client.socket_path, sb.client.token) as c:
            burstrl_exec_true(c)
            out["start_ms"].append((time.perf_counter() - t0) * 1e3)
            if i == 0:
                for _ in range(CALLS):
                    t1 = time.perf_counter()
                    burstrl_exec_true(c)
                    out["true_ms"].append((time.perf_counter() - t1) * 1e3)
    finally:
        sb.close()
shutil.rmtree(state, ignore_errors=True)
print(json.dumps(out))
"""


def run_round(tree: Path, kind: str, starts: int, calls: int) -> dict[str, list[float]]:
    """One worker round of `tree` on backend `kind`."""
    head = f"BENCH = {str(REPO / 'benchmarks')!r}\nKIND = {kind!r}\nSTARTS = {starts}\nCALLS = {calls}\n"
    r = subprocess.run([sys.executable, "-c", head + WORKER], capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                            "PYTHONPATH": str(tree / "src")}, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} on {tree}: {r.stderr[-1500:]}")
    return json.loads(r.stdout.splitlines()[-1])


def available(kind: str) -> bool:
    """Whether `kind` runs here (runsc may be missing)."""
    if kind == "namespace":
        return True
    sys.path.insert(0, str(REPO / "src"))
    from burstrl.sandbox.backends.oci import runtime_works

    with tempfile.TemporaryDirectory(prefix="sbx", dir="/tmp") as d:
        return runtime_works(kind.removeprefix("oci-"), Path(d))[0]


def checkout(rev: str) -> Path:
    """`rev` as a plain tree (`git archive`), in a temp dir left for the caller's run."""
    dest = Path(tempfile.mkdtemp(prefix="burstrl-before-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def measure(before: Path, kinds: list[str], rounds: int, starts: int, calls: int) -> dict[str, Any]:
    """Per backend: medians of both trees and their ratios, rounds alternated (before first on even rounds)."""
    out: dict[str, Any] = {}
    for kind in kinds:
        got: dict[str, dict[str, list[float]]] = {"before": {"start_ms": [], "true_ms": []},
                                                  "after": {"start_ms": [], "true_ms": []}}
        for i in range(rounds):
            order = [("before", before), ("after", REPO)] if i % 2 == 0 else [("after", REPO), ("before", before)]
            for name, tree in order:
                res = run_round(tree, kind, starts, calls)
                for key in got[name]:
                    got[name][key] += res[key]
        med = {name: {k: round(statistics.median(v), 3) for k, v in d.items()} for name, d in got.items()}
        out[kind] = {**med, "ratio": {k: round(med["after"][k] / med["before"][k], 3) for k in med["after"]}}
    return out


def table(res: dict[str, Any]) -> str:
    rows = ["| backend | start p50 before / after (ms) | ratio | `true` p50 before / after (ms) | ratio |",
            "|---|---|---|---|---|"]
    for kind, r in res.items():
        rows.append(f"| {kind} | {r['before']['start_ms']} / {r['after']['start_ms']} | {r['ratio']['start_ms']} "
                    f"| {r['before']['true_ms']} / {r['after']['true_ms']} | {r['ratio']['true_ms']} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="", help="git revision to compare with (git archive of its src/)")
    p.add_argument("--before-dir", default="", help="a tree (with src/) to compare with")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--starts", type=int, default=3, help="sandboxes started per round")
    p.add_argument("--calls", type=int, default=100, help="`true` execs per round")
    p.add_argument("--backends", default=",".join(BACKENDS))
    args = p.parse_args()
    if bool(args.before) == bool(args.before_dir):
        p.error("give exactly one of --before REV or --before-dir DIR")
    before = Path(args.before_dir) if args.before_dir else checkout(args.before)
    kinds = [k for k in args.backends.split(",") if available(k)]
    res = measure(before, kinds, args.rounds, args.starts, args.calls)
    print(json.dumps(res))
    print(table(res))


if __name__ == "__main__":
    main()
