"""What an ecosystem adapter adds per episode, against a native environment doing the same work (issue 38).

Two families of cases; each adapter case is compared with the native case of its family (`BASELINE`):

OpenEnv, a scripted model (`native` vs `openenv`). Each case plays the arithmetic game of
`examples/openenv_envs/arith` (add two numbers, up to 3 tries) with the same prompts, parsing and rewards:
- native:  `arith/native.py`, a burstrl environment, in process;
- openenv: `arith/server.py`, openenv's own server (uvicorn, a child process), through the adapter
  "openenv:<url>" (`envs/ecosystem/openenv_env.py`) over its /ws socket.
The model is a scripted client that answers at once, wrong then right (reset + 2 steps, 2 calls an
episode), so what is timed is the environment's side alone.

verifiers, a real model (`native_sum` vs `vf_legacy_sum` and `vf_v1_sum`). The verifiers adapters call
the model over HTTP themselves (legacy: an openai client on `SessionClient.sdk_http()`; v1: verifiers'
interception server and its own client, `{router}/v1/chat/completions` with `session_id` in the body),
so no in-process client can stand in for the model: these cases share one real fleet started here,
a replica (`burstrl serve`, the tiny test model, one engine thread) behind the real router, and each
episode is one `run_attempt` (rollout, fetch the capture, release), as the orchestrator runs it, on
version `base` at `--temperature` (0: greedy, the same tokens for the same prompt) and `--max-tokens`.
Each case plays the vf_sum task (`examples/verifiers_envs`: "What is a + b?", one model call, reward 1
when the reply's last number is the answer), over the same 4 questions drawn in the same order:
- native_sum:    `native_sum.py`, a burstrl environment calling `client.chat` once (system prompt
                 "Answer with a number.", as vf_sum_legacy);
- vf_legacy_sum: "verifiers:vf_sum_legacy" (`vf.SingleTurnEnv` + `vf.Rubric`, run by `vf_legacy`);
- vf_v1_sum:     "verifiers:vf_sum_v1" (a v1 taskset, run by `vf_v1` in its in-process harness); it
                 has no system prompt, so its prompts are a few tokens shorter (see prompt_tokens).
The model's work per episode is the same in the three (one call, `completion_tokens` tokens), so
the differences are what verifiers and the adapter add on the orchestrator's side (client_cpu_ms,
which holds the v1 interception server too) and at the router/replica (router_cpu_ms, replica_cpu_ms:
what the requests verifiers sends cost there).

Per case: wall ms per episode (one at a time, after a warm-up), CPU ms per episode of this process
(the orchestrator's side) and of the processes serving it (the OpenEnv server; the router and the
replica) and their sum (total_cpu_ms), and the wall time per episode of `--concurrency` episodes at
once; then each adapter case minus its baseline and divided by it (a server the baseline does not
have counts 0 there), as JSON lines and a markdown table.

To measure another adapter, add a function to CASES that starts what it needs on the ExitStack
(`fleet(stack)` for a real model) and returns a Case.

    .venv/bin/python benchmarks/ecosystem_overhead.py [--episodes 200] [--concurrency 8] [--cases native,openenv]
    .venv/bin/python benchmarks/ecosystem_overhead.py --cases native_sum,vf_legacy_sum,vf_v1_sum --episodes 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VF_EXAMPLES = REPO / "examples" / "verifiers_envs"
sys.path[:0] = [str(REPO / "src"), str(REPO), str(VF_EXAMPLES)]
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replica's torch: one thread on a small shared machine

import httpx  # noqa: E402

from burstrl.envs.base import Environment, close_env  # noqa: E402

TINY_MODEL_DIR = REPO / ".cache" / "tiny-qwen3"  # the test suite's cache (tests/conftest.py)
VERSION = "base"
ADMIN_TOKEN = secrets.token_urlsafe(16)


@dataclass
class Fleet:
    """A replica behind the router, and how this benchmark's attempts call it."""

    router: str
    admin_token: str
    pids: dict[str, int]  # "router", "replica"
    temperature: float = 0.0
    max_tokens: int = 8


@dataclass
class Case:
    env: Environment
    server_pid: int | None = None  # a process doing the environment's work outside this one
    fleet: Fleet | None = None  # episodes run through `run_attempt` on this fleet, else a scripted model


SETTINGS = {"temperature": 0.0, "max_tokens": 8}  # set from the command line
_FLEETS: dict[int, Fleet] = {}  # one fleet per ExitStack, shared by its cases


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


def tiny_model() -> Path:
    """The tiny test model, built (in a child: this process never imports torch) unless cached."""
    code = ("import fcntl, sys; from pathlib import Path; from burstrl.model.tiny import ensure_tiny_model\n"
            "out = Path(sys.argv[1]); out.parent.mkdir(parents=True, exist_ok=True)\n"
            "with open(out.parent / f'.{out.name}.lock', 'w') as lock:\n"  # tests/conftest.py's build lock
            "    fcntl.flock(lock, fcntl.LOCK_EX); print(ensure_tiny_model(out))")
    out = subprocess.run([sys.executable, "-c", code, str(TINY_MODEL_DIR)], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    return Path(out.stdout.strip().splitlines()[-1])


def fleet(stack: ExitStack) -> Fleet:
    """The stack's fleet, started on first use: a replica of the tiny model behind the router."""
    if id(stack) in _FLEETS:
        return _FLEETS[id(stack)]
    from burstrl.protocol.process import start_replica, start_router

    model = tiny_model()
    root = Path(tempfile.mkdtemp(prefix="burstrl-overhead-"))
    stack.callback(shutil.rmtree, root, True)
    replica = start_replica(model, root / "replica", "--server.admin_token", ADMIN_TOKEN,
                            "--server.state_dir", str(root / "state"), "--engine.num_threads", "1")
    stack.callback(replica.stop)
    router = start_router(root / "router", "--cluster_token", secrets.token_urlsafe(16),
                          "--replicas", json.dumps([replica.url]), "--scrape_s", "0.5")
    stack.callback(router.stop)
    deadline = time.monotonic() + 60
    while VERSION not in httpx.get(f"{router.url}/v1/models", timeout=30).text:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router never listed {VERSION!r}")
        time.sleep(0.2)
    f = Fleet(router=router.url, admin_token=ADMIN_TOKEN, pids={"router": router.proc.pid, "replica": replica.proc.pid},
              **SETTINGS)
    _FLEETS[id(stack)] = f
    stack.callback(_FLEETS.pop, id(stack), None)
    return f


def native_sum_case(stack: ExitStack) -> Case:
    from native_sum import NativeSumEnv

    return Case(env=NativeSumEnv(), fleet=fleet(stack))


def verifiers_case(module: str, check: Callable[[dict[str, Any], dict[str, str]], bool]) -> Callable[[ExitStack], Case]:
    """The case of "verifiers:<module>", checked to hold native_sum's rows (in its draw order)."""

    def make(stack: ExitStack) -> Case:
        from native_sum import NativeSumEnv

        from burstrl.envs import get_env

        env = get_env(f"verifiers:{module}")
        mine, native = env.make_tasks(8, 0), NativeSumEnv().make_tasks(8, 0)  # loads verifiers and the env
        bad = [(a.data, b.data) for a, b in zip(mine, native, strict=True) if not check(a.data, b.data)]
        if bad:
            raise RuntimeError(f"verifiers:{module} does not play native_sum's tasks: {bad[0]}")
        return Case(env=env, fleet=fleet(stack))

    return make


def _legacy_row(data: dict[str, Any], native: dict[str, str]) -> bool:
    from native_sum import SYSTEM_PROMPT

    return data["answer"] == native["answer"] and data["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": native["question"]}]


def _v1_row(data: dict[str, Any], native: dict[str, str]) -> bool:
    return str(data["answer"]) == native["answer"] and data["prompt"] == native["question"]


CASES: dict[str, Callable[[ExitStack], Case]] = {
    "native": native_case, "openenv": openenv_case, "native_sum": native_sum_case,
    "vf_legacy_sum": verifiers_case("vf_sum_legacy", _legacy_row), "vf_v1_sum": verifiers_case("vf_sum_v1", _v1_row),
}
BASELINE = {"openenv": "native", "vf_legacy_sum": "native_sum", "vf_v1_sum": "native_sum"}
TIMINGS = ("wall_ms", "client_cpu_ms", "server_cpu_ms", "router_cpu_ms", "replica_cpu_ms", "total_cpu_ms")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Episodes:
    """Runs a case's episodes: its env against the scripted model, or as attempts on its fleet."""

    def __init__(self, name: str, case: Case, http: httpx.AsyncClient) -> None:
        self.name, self.case, self.http = name, case, http
        self.tokens: list[tuple[int, int]] = []  # (prompt, completion) of each captured call
        self.failed = 0  # attempts the env scored as the model's failure (reason set)

    async def run(self, n: int, seed: int, concurrency: int) -> None:
        tasks = self.case.env.make_tasks(n, seed)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, task: Any) -> None:
            async with gate:
                await (self.scripted(task) if self.case.fleet is None else self.attempt(task, f"s{seed}-{i:05d}", i))

        await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))

    async def scripted(self, task: Any) -> None:
        outcome = await self.case.env.rollout(Scripted(), task)
        assert outcome.passed, outcome  # the scripted policy always solves it on the second try

    async def attempt(self, task: Any, key: str, i: int) -> None:
        from burstrl.orchestrator.attempt import run_attempt

        f = self.case.fleet
        rollout = await run_attempt(self.http, f.router, self.case.env, task, f"overhead-{self.name}-{key}", VERSION,
                                    f.temperature, f.max_tokens, 1000 + i, f.admin_token)
        assert rollout.calls == len(rollout.turns) == 1, (self.name, rollout)  # one call, captured whole
        self.failed += rollout.status != "complete"
        self.tokens += [(len(t.prompt_ids), len(t.completion_ids)) for t in rollout.turns]


def server_pids(case: Case) -> dict[str, int]:
    pids = {"server": case.server_pid} if case.server_pid else {}
    return pids | (case.fleet.pids if case.fleet else {})


async def measure(name: str, case: Case, n: int, concurrency: int) -> dict[str, float]:
    """ms per episode one at a time (wall, this process's CPU, each server's CPU), the wall per
    episode of a concurrent batch, and (with a fleet) the tokens of a call and the failed attempts."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)  # as the orchestrator's
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), limits=limits) as http:
        runner = Episodes(name, case, http)
        try:
            await runner.run(5, seed=1, concurrency=1)  # warm: connections, schema, serving, first imports
            pids = server_pids(case)
            servers0 = {k: process_cpu_s(pid) for k, pid in pids.items()}
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await runner.run(n, seed=2, concurrency=1)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            servers = {f"{k}_cpu_ms": 1000 * (process_cpu_s(pid) - servers0[k]) / n for k, pid in pids.items()}
            wall1 = time.perf_counter()
            await runner.run(n, seed=3, concurrency=concurrency)
            batch = time.perf_counter() - wall1
        finally:
            if case.fleet is not None:
                await close_env(case.env)  # the v1 adapter's serving lives on this loop
    out = {"wall_ms": 1000 * wall / n, "client_cpu_ms": 1000 * cpu / n, **servers,
           "total_cpu_ms": 1000 * cpu / n + sum(servers.values()), f"wall_ms_at_{concurrency}": 1000 * batch / n}
    if case.fleet is not None:
        out |= {"prompt_tokens": sum(p for p, _ in runner.tokens) / len(runner.tokens),
                "completion_tokens": sum(c for _, c in runner.tokens) / len(runner.tokens), "failed": runner.failed}
    return out


def overhead(result: dict[str, float], base: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """result - base and result / base, for the timings (a server the base has not costs it 0 CPU)."""
    keys = [k for k in result if k in TIMINGS or k.startswith("wall_ms_at_")]
    return ({k: round(result[k] - base.get(k, 0.0), 3) for k in keys},
            {k: round(result[k] / base[k], 2) if base.get(k) else None for k in keys})


def markdown(results: dict[str, dict[str, float]]) -> str:
    cols = list(dict.fromkeys(k for r in results.values() for k in r))
    rows = ["| case | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    rows += [f"| {name} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for name, r in results.items()]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--max-tokens", type=int, default=8, help="per model call (cases on the fleet)")
    p.add_argument("--temperature", type=float, default=0.0, help="cases on the fleet; 0 = greedy")
    args = p.parse_args()
    SETTINGS.update(temperature=args.temperature, max_tokens=args.max_tokens)
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    results: dict[str, dict[str, float]] = {}
    on_fleet = False
    with ExitStack() as stack:
        for name in names:
            case = CASES[name](stack)
            on_fleet |= case.fleet is not None
            load0 = os.getloadavg()[0]
            r = asyncio.run(measure(name, case, args.episodes, args.concurrency))
            results[name] = {k: round(v, 3) for k, v in r.items()} | {"load": round(load0, 2)}
            print(json.dumps({"case": name, **results[name]}), flush=True)
    table = dict(results)
    for name, r in results.items():
        base = BASELINE.get(name)
        if base in results:
            diff, ratio = overhead(r, results[base])
            print(json.dumps({"case": f"{name} - {base}", **diff}))
            print(json.dumps({"case": f"{name} / {base}", **ratio}))
            table[f"{name} - {base}"], table[f"{name} / {base}"] = diff, ratio
    fleet_settings = {"max_tokens": args.max_tokens, "temperature": args.temperature} if on_fleet else {}
    print(json.dumps({"episodes": args.episodes, "concurrency": args.concurrency, "load": os.getloadavg()[0],
                      "cpus": os.cpu_count(), **fleet_settings}))
    print(markdown(table))


if __name__ == "__main__":
    main()
