"""The OpenEnv adapter (`envs/ecosystem/openenv_env.py`) against a hostile stand-in server.

The stand-in speaks OpenEnv's wire protocol (/health and /schema over HTTP, JSON frames at /ws) with
`websockets` in a background thread; the path prefix of the URL picks its behaviour, so one server
serves every case (`http://127.0.0.1:PORT/<mode>`). The real openenv server is the integration
test's (tests/integration/test_openenv_env.py). Model replies come from a scripted client.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import serve

from burstrl.envs.base import InfraError
from burstrl.envs.ecosystem import openenv_docker
from burstrl.envs.ecosystem.openenv_env import OpenEnvEnv, OpenEnvOptions, ReplyError, parse_reply, reset_seed
from burstrl.envs.ecosystem.openenv_ws import Endpoint, endpoint
from burstrl.envs.registry import env_options, get_env
from burstrl.orchestrator.client import ReplicaFailure

SCHEMA = {"title": "SumAction", "type": "object", "required": ["answer"],
          "properties": {"answer": {"type": "integer"}}}
BAD_FRAMES = {  # mode -> what the server answers to reset
    "notjson": "hello", "list": "[1, 2]", "nodata": '{"type": "observation"}',
    "obslist": '{"type": "observation", "data": {"observation": [1], "done": false}}',
    "rewardstr": '{"type": "observation", "data": {"observation": {}, "reward": "1", "done": false}}',
    "rewardnan": '{"type": "observation", "data": {"observation": {}, "reward": NaN, "done": false}}',
    "rewardhuge": '{"type": "observation", "data": {"observation": {}, "reward": 1%s, "done": false}}' % ("0" * 400),
    "doneyes": '{"type": "observation", "data": {"observation": {}, "reward": 0, "done": "yes"}}',
    "statetype": '{"type": "state", "data": {"step_count": 0}}',
    "deep": "[" * 5000 + "]" * 5000,
    "reseterror": '{"type": "error", "data": {"message": "bad seed", "code": "VALIDATION_ERROR"}}',
}


def obs(question: str = "What is 2 + 3?", reward: Any = None, done: bool = False, **extra: Any) -> str:
    return json.dumps({"type": "observation", "data": {"observation": {"question": question, **extra},
                                                       "reward": reward, "done": done}})


class FakeOpenEnv:
    """A stand-in OpenEnv server; `seen[mode]` keeps the reset data it got, `open`/`peak` count sockets."""

    def __init__(self) -> None:
        self.seen: dict[str, list[dict]] = {}
        self.connections: Counter[str] = Counter()
        self.open, self.peak = 0, 0
        self.closed: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(30), "the stand-in server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        async def main() -> None:
            async with serve(self.handler, "127.0.0.1", 0, process_request=self.http, max_size=None,
                             compression=None) as server:
                self.port = server.sockets[0].getsockname()[1]
                ready.set()
                await asyncio.Future()

        self.loop.run_until_complete(main())

    def http(self, connection: Any, request: Any) -> Any:
        mode, _, what = request.path.strip("/").rpartition("/")
        if what == "ws":
            return connection.respond(HTTPStatus.NOT_FOUND, "no ws") if mode == "nows" else None
        if what == "health":
            return connection.respond(HTTPStatus.OK, '{"status": "healthy"}')
        schemas = {"noschema": None, "badschema": '{"action": 3}',
                   "bigschema": json.dumps({"action": {"x": "y" * 20_000}})}
        body = schemas.get(mode, json.dumps({"action": SCHEMA}))
        return connection.respond(HTTPStatus.OK if body else HTTPStatus.NOT_FOUND, body or "no")

    async def handler(self, ws: Any) -> None:
        mode = ws.request.path.strip("/").rpartition("/")[0]
        self.connections[mode] += 1
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            await self.episode(ws, mode)
        except Exception:
            pass
        finally:
            self.open -= 1

    async def episode(self, ws: Any, mode: str) -> None:
        if mode == "capacity" or (mode == "capacity1" and self.connections[mode] == 1):
            await ws.send('{"type": "error", "data": {"message": "full", "code": "CAPACITY_REACHED"}}')
            return
        tries = 0
        async for raw in ws:
            msg = json.loads(raw)
            if msg["type"] == "close":
                self.closed[mode] += 1
                return
            if msg["type"] == "reset":
                self.seen.setdefault(mode, []).append(msg["data"])
                if mode == "silentreset":
                    continue
                await ws.send(self.reset_answer(mode))
                continue
            tries += 1
            answer = self.step_answer(mode, msg["data"], tries)
            if answer is None:
                if mode == "close":
                    return
                continue  # silent
            await ws.send(answer)

    def reset_answer(self, mode: str) -> Any:
        if mode in BAD_FRAMES:
            return BAD_FRAMES[mode]
        if mode == "binary":
            return b"\x00\x01"
        if mode == "huge":
            return obs("x" * 20_000)
        if mode == "hugeobs":
            return obs("y" * 9_000)
        if mode == "doneatreset":
            return obs(done=True)
        if mode == "surrogate":
            return obs("What is 2 + 3? \ud800")  # json.dumps escapes it; the client decodes a lone surrogate
        return obs()

    def step_answer(self, mode: str, action: dict, tries: int) -> str | None:
        if mode in ("close", "silent"):
            return None
        if mode == "reject":
            return json.dumps({"type": "error", "data": {"message": "Invalid message", "code": "VALIDATION_ERROR",
                                                        "errors": [{"msg": "Field required", "loc": ["answer"]}]}})
        if mode == "crash":
            return '{"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}'
        if mode == "weird":
            return '{"type": "error", "data": {"message": "?", "code": "SESSION_ERROR"}}'
        if mode == "bigreward":
            return obs(reward=1e308 if tries < 3 else -(10**400) // 10**100)  # 1e308 twice, then -1e300
        if mode == "boolreward":
            return obs(reward=True, done=True)
        if mode == "growing":
            return obs("z" * 3000, reward=0.0)
        right = action.get("answer") == 5
        return obs(reward=1.0 if right else 0.0, done=right or tries >= 3, hint="" if right else "no")


@pytest.fixture(scope="module")
def fake() -> FakeOpenEnv:
    return FakeOpenEnv()


class Scripted:
    """A ChatClient whose replies are given; it keeps every conversation it was sent."""

    def __init__(self, *replies: str, fail_at: int | None = None) -> None:
        self.replies, self.fail_at = list(replies), fail_at
        self.calls, self.sent = 0, []
        self.session_id = "sess-1"

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        json.dumps(messages).encode("utf-8")  # what an HTTP body must carry
        self.sent.append([dict(m) for m in messages])
        if self.fail_at == self.calls:
            raise ReplicaFailure("replica gone")
        self.calls += 1
        return self.replies.pop(0) if self.replies else "0"


def adapter(url: str, **options: Any) -> OpenEnvEnv:
    cls = type("Bound", (OpenEnvEnv,), {"spec": url, "name": f"openenv:{url}"})
    return cls(OpenEnvOptions(**options))


def play(env: OpenEnvEnv, client: Scripted, seed: int = 0) -> Any:
    return asyncio.run(env.rollout(client, env.make_tasks(1, seed)[0]))


# ---- the glue ----
@pytest.mark.parametrize("reply,action", [
    ('{"answer": 5}', {"answer": 5}),
    ('  ```json\n{"answer": 5}\n```  ', {"answer": 5}),
    ("```\n5\n```", {"answer": 5}),
    ("5", {"answer": 5}),
    ("five", {"answer": "five"}),
    ("[1, 2]", {"answer": [1, 2]}),
    ('{"other": 1}', {"other": 1}),  # an object is the action as is: the server validates it
])
def test_a_reply_is_a_json_action_or_the_single_required_field(reply: str, action: dict) -> None:
    assert parse_reply(reply, SCHEMA) == action


@pytest.mark.parametrize("reply,schema", [
    ("", SCHEMA), ("  \n", SCHEMA), ("5", {"required": ["a", "b"]}), ("5", {}), ("NaN", SCHEMA),
    ('{"answer": Infinity}', SCHEMA),
])
def test_a_reply_without_an_action_is_a_reply_error(reply: str, schema: dict) -> None:
    with pytest.raises(ReplyError):
        parse_reply(reply, schema)


def test_tasks_are_reset_seeds_deterministic_and_held_out_by_parity() -> None:
    env = adapter("http://127.0.0.1:1")
    train, again = env.make_tasks(50, 3), env.make_tasks(50, 3)
    assert train == again and len({t.id for t in train + env.make_tasks(50, 4)}) == 100
    assert all(t.data["seed"] % 2 == 0 for t in train)
    assert all(t.data["seed"] % 2 == 1 for t in env.make_tasks(50, 3, split="test"))
    assert all(0 <= reset_seed(s, 10**9, i) < 2**31 for s in ("train", "test") for i in range(20))
    assert train[0].id != adapter("http://127.0.0.1:2").make_tasks(1, 3)[0].id  # two servers, two id spaces


@pytest.mark.parametrize("url,http,ws", [
    ("http://h:1", "http://h:1", "ws://h:1/ws"), ("https://h/p/", "https://h/p", "wss://h/p/ws"),
    ("ws://h:1/ws", "http://h:1", "ws://h:1/ws"), ("wss://h/p/ws", "https://h/p", "wss://h/p/ws"),
])
def test_a_url_names_the_http_base_and_the_socket(url: str, http: str, ws: str) -> None:
    assert endpoint(url) == Endpoint(http=http, ws=ws)


def test_the_registry_binds_the_spec_and_validates_options_by_name() -> None:
    name = "openenv:http://127.0.0.1:9/prefix"
    opts = type("O", (), {"env": {name: {"max-turns": 2, "reset_args": {"level": 1}}}})()
    env = get_env(name, opts)
    assert isinstance(env, OpenEnvEnv) and env.spec == "http://127.0.0.1:9/prefix" and env.name == name
    assert env.options.max_turns == 2 and env._endpoint.ws == "ws://127.0.0.1:9/prefix/ws"
    with pytest.raises(ValueError, match="bogus"):
        env_options(type(env), type("O", (), {"env": {name: {"bogus": 1}}})())


def test_the_adapter_never_imports_openenv() -> None:
    code = ("import sys, burstrl.envs.ecosystem.openenv_env; "
            "print(sorted(m for m in ('openenv', 'gradio', 'fastmcp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# ---- episodes ----
def test_an_episode_sums_step_rewards_and_sends_the_task_seed(fake: FakeOpenEnv) -> None:
    env = adapter(f"{fake.url}/ok", reset_args={"level": 2, "seed": -1})
    client = Scripted("7", '```json\n{"answer": 5}\n```')
    out = play(env, client, seed=11)
    assert (out.reward, out.passed, out.parts) == (1.0, True, {"env_reward": 1.0, "valid": 1.0})
    assert out.info == {"ended": "done", "steps": 2, "rewards": [0.0, 1.0]} and client.calls == 2
    first = client.sent[0]
    assert first[0]["role"] == "system" and json.loads(first[1]["content"]) == {
        "observation": {"question": "What is 2 + 3?"}, "action_schema": SCHEMA}
    assert [m["role"] for m in client.sent[1]] == ["system", "user", "assistant", "user"]
    assert fake.seen["ok"][-1] == {"level": 2, "seed": env.make_tasks(1, 11)[0].data["seed"], "episode_id": "sess-1"}


def test_max_turns_ends_an_episode_without_failing_it(fake: FakeOpenEnv) -> None:
    out = play(adapter(f"{fake.url}/ok", max_turns=2, system_prompt=""), client := Scripted("1", "2"))
    assert out.info["ended"] == "max_turns" and "reason" not in out.info and out.reward == 0.0
    assert client.sent[0][0]["role"] == "user"


@pytest.mark.parametrize("mode,reply,why", [
    ("ok", "", "empty reply"),
    ("reject", "5", "invalid action: Field required"),
    ("crash", "5", "the environment failed on the action: boom"),
])
def test_a_bad_action_is_the_models_failure(fake: FakeOpenEnv, mode: str, reply: str, why: str) -> None:
    out = play(adapter(f"{fake.url}/{mode}"), Scripted(reply))
    assert out.reward == 0.0 and not out.passed and out.parts["valid"] == 0.0
    assert why in out.info["reason"]


INFRA = {  # mode -> what the InfraError says
    "list": "without a data object", "nodata": "without a data object", "notjson": "not JSON", "deep": "not JSON",
    "obslist": "not an object", "rewardstr": "not a finite number", "rewardnan": "not a finite number",
    "rewardhuge": "not a finite number", "doneyes": "not a boolean", "statetype": "not an observation",
    "reseterror": "server error VALIDATION_ERROR", "binary": "binary frame", "huge": "connection failed",
    "doneatreset": "ended the episode at reset", "hugeobs": "over max_context_chars",
    "noschema": "HTTP 404", "badschema": "no action schema",
    "bigschema": "over 16384 bytes", "nows": "cannot open",
}


@pytest.mark.parametrize("mode,match", sorted(INFRA.items()))
def test_a_bad_server_is_an_infra_error(fake: FakeOpenEnv, mode: str, match: str) -> None:
    env = adapter(f"{fake.url}/{mode}", max_frame_bytes=16384, timeout_s=10)
    with pytest.raises(InfraError, match=match):
        play(env, Scripted("1", "1", "1"))


def test_step_rewards_are_clipped_and_a_boolean_one_counts_as_one(fake: FakeOpenEnv) -> None:
    """One server's 1e300 would swamp its group's advantages (issue 49, noted): clipped, and said so."""
    out = play(adapter(f"{fake.url}/bigreward", max_turns=3, reward_clip=100), Scripted("1", "1", "1"))
    assert out.info["rewards"] == [100.0, 100.0, -100.0] and out.info["clipped_steps"] == 3
    assert out.reward == 100.0 and out.parts["env_reward"] == 100.0
    out = play(adapter(f"{fake.url}/boolreward"), Scripted("1"))
    assert out.reward == 1.0 and out.passed and "clipped_steps" not in out.info


AFTER_ACTION = {"weird": "SESSION_ERROR", "close": "connection failed", "silent": "no answer"}


@pytest.mark.parametrize("mode,match", sorted(AFTER_ACTION.items()))
def test_a_server_failing_after_the_action_is_the_models_failure(fake: FakeOpenEnv, mode: str, match: str) -> None:
    """An action may crash or hang the server: scored 0 with the reason, never a re-run a policy could farm."""
    start = time.monotonic()
    out = play(adapter(f"{fake.url}/{mode}", timeout_s=0.5), Scripted("1", "1", "1"))
    assert out.reward == 0 and not out.passed and out.parts["valid"] == 0
    assert out.info["reason"].startswith("env_failed_after_action:") and match in out.info["reason"]
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("mode", ["silentreset", "capacity"])
def test_a_server_that_never_answers_costs_bounded_time(fake: FakeOpenEnv, mode: str) -> None:
    start = time.monotonic()
    with pytest.raises(InfraError, match="no answer|capacity"):
        play(adapter(f"{fake.url}/{mode}", timeout_s=0.5), Scripted("1"))
    assert time.monotonic() - start < 10


def test_a_server_at_capacity_is_asked_again(fake: FakeOpenEnv) -> None:
    out = play(adapter(f"{fake.url}/capacity1"), Scripted("5"))
    assert out.passed and fake.connections["capacity1"] == 2


def test_a_growing_conversation_ends_at_the_context_budget(fake: FakeOpenEnv) -> None:
    out = play(adapter(f"{fake.url}/growing", max_context_chars=8000, max_turns=50), client := Scripted())
    assert out.info["ended"] == "context" and "reason" not in out.info and 1 < client.calls < 5
    assert sum(len(m["content"]) for m in client.sent[-1]) <= 8000


def test_lone_surrogates_from_the_server_reach_the_model_escaped(fake: FakeOpenEnv) -> None:
    client = Scripted("5")
    assert play(adapter(f"{fake.url}/surrogate"), client).passed
    assert "\\ud800" in client.sent[0][-1]["content"]


def test_a_fleet_failure_propagates_and_the_session_is_closed(fake: FakeOpenEnv) -> None:
    before = fake.closed["ok"]
    with pytest.raises(ReplicaFailure):
        play(adapter(f"{fake.url}/ok"), Scripted("7", fail_at=1))
    deadline = time.monotonic() + 30
    while fake.closed["ok"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.closed["ok"] == before + 1


def test_max_sessions_bounds_open_episodes(fake: FakeOpenEnv) -> None:
    env = adapter(f"{fake.url}/ok", max_sessions=2)

    async def many() -> list:
        tasks = env.make_tasks(6, 5)
        return await asyncio.gather(*(env.rollout(Scripted("5"), t) for t in tasks))

    fake.peak = fake.open
    assert all(o.passed for o in asyncio.run(many()))
    assert fake.peak <= 2


# ---- check() ----
def test_check_accepts_a_server_that_speaks_openenv(fake: FakeOpenEnv) -> None:
    type(adapter(f"{fake.url}/ok")).check(OpenEnvOptions())


@pytest.mark.parametrize("spec,match", [
    ("ftp://host/x", "must start with"), ("http://", "no host"), ("http://h:99999", "bad port"),
    ("http://h:1?x=1", "query"), ("-rm", "neither"), ("a b", "neither"),
])
def test_check_names_a_bad_spec(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        type("B", (OpenEnvEnv,), {"spec": spec, "name": f"openenv:{spec}"}).check()


@pytest.mark.parametrize("mode,match", [("nows", "WebSocket"), ("noschema", "HTTP 404"),
                                        ("badschema", "no action schema"), ("bigschema", "over 4096 bytes")])
def test_check_names_what_the_server_lacks(fake: FakeOpenEnv, mode: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        type(adapter(f"{fake.url}/{mode}")).check(OpenEnvOptions(max_frame_bytes=4096))


def test_check_names_an_unreachable_server() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match="ConnectError"):
        type(adapter(f"http://127.0.0.1:{port}")).check(OpenEnvOptions(timeout_s=5))


# ---- images (a stand-in docker CLI: the real one needs a daemon this machine lacks) ----
FAKE_DOCKER = """#!/bin/sh
echo "$@" >> "$DOCKER_LOG"
case "$1" in
  version) [ -n "$DOCKER_DOWN" ] && { echo "Cannot connect to the Docker daemon" >&2; exit 1; }; echo 28.2 ;;
  run) echo cid123 ;;
  port) echo "$FAKE_ADDR" ;;
esac
"""


@pytest.fixture
def docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_LOG", str(tmp_path / "docker.log"))
    return tmp_path / "docker.log"


def test_check_of_an_image_needs_docker(docker: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bound = type("B", (OpenEnvEnv,), {"spec": "ghcr.io/org/env:1", "name": "openenv:ghcr.io/org/env:1"})
    bound.check()
    monkeypatch.setenv("DOCKER_DOWN", "1")
    with pytest.raises(ValueError, match="cannot reach its daemon"):
        bound.check()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not installed"):
        bound.check()


def test_an_image_is_run_on_loopback_played_and_removed(fake: FakeOpenEnv, docker: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ADDR", fake.url.removeprefix("http://"))  # the root path plays "ok"
    env = adapter("org/arith:latest")
    assert play(env, Scripted("5")).passed
    env.close()
    env.close()
    name = env._container.name
    assert docker.read_text().splitlines() == [
        "version --format {{.Server.Version}}", f"run -d --rm --name {name} -p 127.0.0.1::8000 org/arith:latest",
        f"port {name} 8000/tcp", f"rm -f {name}"]


def test_an_image_that_never_gets_healthy_is_removed_and_infra(docker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ADDR", "127.0.0.1:1")
    env = adapter("org/broken", start_timeout_s=0.5)
    with pytest.raises(InfraError, match="did not answer"):
        play(env, Scripted("5"))
    assert docker.read_text().splitlines()[-1] == f"rm -f {env._container.name}"


def test_the_docker_problem_is_none_only_with_a_daemon() -> None:
    problem = openenv_docker.docker_problem(timeout_s=20)
    assert problem is None or "docker" in problem
