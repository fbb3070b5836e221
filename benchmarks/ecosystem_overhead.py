"""What an ecosystem adapter adds per episode, against a native environment doing the same work (issue 38).

Each case is one environment playing the arithmetic game of `examples/openenv_envs/arith` (add two
numbers, up to 3 tries) with the same prompts, parsing and rewards:
- native:  `arith/native.py`, a burstrl environment, in process;
- openenv: `arith/server.py`, openenv's own server (uvicorn, a child process), through the adapter
  "openenv:<url>" (`envs/ecosystem/openenv_env.py`) over its /ws socket.
The model is a scripted client that answers at once, wrong then right (reset + 2 steps, 2 calls an
episode), so what is timed is the environment's side alone. Per case: wall ms per episode (one at a
time, after a warm-up), CPU ms per episode of this process (the orchestrator's side) and of the
server process (from /proc), and the wall time of `--concurrency` episodes at once.

To measure another adapter (verifiers), add a function to CASES that starts what it needs on the
ExitStack and returns a Case.

    .venv/bin/python benchmarks/ecosystem_overhead.py [--episodes 200] [--concurrency 8] [--cases native,openenv]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]

from burstrl.envs.base import Environment  # noqa: E402


@dataclass
class Case:
    env: Environment
    server_pid: int | None = None  # a process doing the environment's work outside this one


class Scripted:
    """An instant policy: a wrong sum first, then the right one (read off the question)."""

    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        self.calls += 1
        question = json.loads(messages[-1]["content"])["observation"]["question"]
        a, b = (int(n) for n in re.findall(r"\d+", question))
        return "0" if self.calls == 1 else f'{{"answer": {a + b}}}'


def native_case(stack: ExitStack) -> Case:
    from examples.openenv_envs.arith.native import NativeArithEnv

    return Case(env=NativeArithEnv())


def openenv_case(stack: ExitStack) -> Case:
    from burstrl.envs import get_env
    from burstrl.protocol.process import ready_url

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")])}
    proc = subprocess.Popen([sys.executable, "-m", "examples.openenv_envs.arith.server", "--port", "0"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    stack.callback(_stop, proc)
    url = None
    while url is None:  # the server imports openenv (~5 CPU-s), then says where it listens
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the arith server exited before it was ready")
        url = ready_url(line)
    adapter = get_env(f"openenv:{url}")
    stack.callback(adapter.close)
    return Case(env=adapter, server_pid=proc.pid)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


CASES: dict[str, Callable[[ExitStack], Case]] = {"native": native_case, "openenv": openenv_case}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def episodes(env: Environment, n: int, seed: int, concurrency: int) -> None:
    tasks = env.make_tasks(n, seed)
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Any) -> None:
        async with gate:
            outcome = await env.rollout(Scripted(), task)
        assert outcome.passed, outcome  # the scripted policy always solves it on the second try

    await asyncio.gather(*(one(t) for t in tasks))


def measure(case: Case, n: int, concurrency: int) -> dict[str, float]:
    """ms per episode one at a time (wall, this process's CPU, the server's CPU) and wall of a concurrent batch."""
    asyncio.run(episodes(case.env, 5, seed=1, concurrency=1))  # warm: connections, schema, first imports
    server0 = process_cpu_s(case.server_pid) if case.server_pid else 0.0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    asyncio.run(episodes(case.env, n, seed=2, concurrency=1))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    server = (process_cpu_s(case.server_pid) - server0) if case.server_pid else 0.0
    wall1 = time.perf_counter()
    asyncio.run(episodes(case.env, n, seed=3, concurrency=concurrency))
    batch = time.perf_counter() - wall1
    return {"wall_ms": 1000 * wall / n, "client_cpu_ms": 1000 * cpu / n, "server_cpu_ms": 1000 * server / n,
            f"wall_ms_at_{concurrency}": 1000 * batch / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = p.parse_args()
    results: dict[str, dict[str, float]] = {}
    with ExitStack() as stack:
        for name in args.cases.split(","):
            results[name] = {k: round(v, 3) for k, v in measure(CASES[name](stack), args.episodes,
                                                                 args.concurrency).items()}
            print(json.dumps({"case": name, **results[name]}), flush=True)
    if "native" in results:
        base = results["native"]
        for name, r in results.items():
            if name != "native":
                print(json.dumps({"case": f"{name} - native", **{k: round(v - base[k], 3) for k, v in r.items()}}))
    print(json.dumps({"episodes": args.episodes, "concurrency": args.concurrency, "load": os.getloadavg()[0],
                      "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
