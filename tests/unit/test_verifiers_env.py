"""The verifiers adapter (`envs/ecosystem/verifiers_env.py` and its `vf_*` stacks) without a model.

Real verifiers 0.3.1 and the real example environments (`examples/verifiers_envs`): detection,
option checks, task draws, how an episode's or a rollout's outcome is read (built from verifiers'
own trace and error types), the pinned harness, the serving lifecycle. The runs against a replica
are the integration test's (tests/integration/test_verifiers_env.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from burstrl.config import OrchestratorSection
from burstrl.envs.base import InfraError
from burstrl.envs.ecosystem.verifiers_env import VerifiersOptions, detect, module_names
from burstrl.envs.registry import check_env, env_class, env_options, get_env
from burstrl.orchestrator.client import ReplicaFailure, SessionClient, VersionGone

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verifiers_envs"

# verifiers and its types, bound by `verifiers_imported` when this file's first test runs, not at
# import: xdist collects every file on every worker, and importing verifiers costs ~5 CPU-s.
vf: Any = None
EmptyModelResponseError = ModelError = SandboxError = Error = ModelCall = TimeSpan = error_data = None
vf_harness = vf_v1 = None  # the adapter's modules that import verifiers


@pytest.fixture(scope="module", autouse=True)
def verifiers_imported() -> None:
    global vf, EmptyModelResponseError, ModelError, SandboxError, Error, ModelCall, TimeSpan, error_data
    global vf_harness, vf_v1
    import verifiers.v1 as vf
    from verifiers.legacy.errors import EmptyModelResponseError, ModelError, SandboxError
    from verifiers.legacy.utils.error_utils import error_data
    from verifiers.v1.trace import Error, ModelCall, TimeSpan

    from burstrl.envs.ecosystem import vf_harness, vf_v1


@pytest.fixture(autouse=True)
def examples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def options(name: str, **section) -> OrchestratorSection:
    return OrchestratorSection(envs={name: 1.0}, env={name: section})


def client() -> SessionClient:
    return SessionClient(None, "http://127.0.0.1:9", "sid-1", "policy-v3", 1.0, 8, 0)  # type: ignore[arg-type]


# ---- which module, which stack, which options ----
def test_module_names_follow_verifiers_own_loaders() -> None:
    assert module_names("someone/Vf-Sum-V1@0.2") == ["verifiers.v1.tasksets.vf_sum_v1", "vf_sum_v1", "Vf_Sum_V1"]
    assert module_names("vf_sum_legacy") == ["verifiers.v1.tasksets.vf_sum_legacy", "vf_sum_legacy"]


@pytest.mark.parametrize(("spec", "kind"), [("vf-sum-v1", "v1"), ("vf_tool_v1", "v1"), ("vf-sum-legacy", "legacy"),
                                            ("owner/vf-tool-legacy@1.0", "legacy")])
def test_detection_tells_v1_tasksets_from_legacy_modules(spec: str, kind: str) -> None:
    assert detect(spec)[0] == kind
    check_env(f"verifiers:{spec}", options(f"verifiers:{spec}"))  # the defaults validate


@pytest.mark.parametrize(("name", "args", "says"), [
    ("verifiers:vf-sum-v1", {"num_taskz": 3}, "taskset.num_taskz\n  Extra inputs are not permitted"),
    ("verifiers:vf-sum-v1", {"num_tasks": "many"}, "taskset.num_tasks"),
    ("verifiers:vf-sum-v1", {"id": "other"}, "args.id"),
    ("verifiers:vf-sum-legacy", {"num_taskz": 3}, "unknown args ['num_taskz']"),
    ("verifiers:vf-tool-legacy", {"num_tasks": 2, "tools": []}, "unknown args ['tools']"),
])
def test_check_names_the_bad_argument(name: str, args: dict, says: str) -> None:
    with pytest.raises(ValueError, match="verifiers:") as err:
        check_env(name, options(name, args=args))
    assert says in str(err.value)


def test_adapter_options_are_checked_too() -> None:
    with pytest.raises(ValueError, match="unknown config key 'bogus'"):
        check_env("verifiers:vf-sum-v1", options("verifiers:vf-sum-v1", bogus=1))
    with pytest.raises(ValueError, match="max_turns is for v1 tasksets"):
        check_env("verifiers:vf-sum-legacy", options("verifiers:vf-sum-legacy", max_turns=3))
    cls = env_class("verifiers:vf-sum-v1")
    assert env_options(cls, options("verifiers:vf-sum-v1", max_turns=3)).max_turns == 3


def write_module(root: Path, name: str, source: str) -> str:
    (root / f"{name}.py").write_text(source)
    return f"verifiers:{name}"


@pytest.mark.parametrize(("source", "says"), [
    ("X = 1\n", "is neither a v1 taskset package"),
    ("raise RuntimeError('boom at import')\n", "failed: RuntimeError: boom at import"),
    ("import no_such_dependency_xyz\n", "No module named 'no_such_dependency_xyz'"),
    ("import verifiers.v1 as vf\nclass A(vf.Taskset):\n    def load(self): return []\nclass B(A): pass\n"
     "__all__ = ['A', 'B']\n", "exports 2 Taskset subclasses"),
])
def test_a_module_that_is_not_a_verifiers_environment_fails_naming_why(tmp_path: Path, monkeypatch, source: str,
                                                                     says: str) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, f"vf_bad_{abs(hash(source)) % 10**8}", source)
    with pytest.raises(ValueError, match=name) as err:
        check_env(name, options(name))
    assert says in str(err.value)


def test_an_unknown_module_fails_naming_it() -> None:
    with pytest.raises(ValueError, match="no module 'no_such_vf_env'.*PYTHONPATH"):
        check_env("verifiers:no-such-vf-env", options("verifiers:no-such-vf-env"))


def test_legacy_arguments_bind_to_the_signature(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, "vf_kwargs_env", "def load_environment(size: int, **kwargs):\n    raise NotImplementedError\n")
    with pytest.raises(ValueError, match="missing a required argument: 'size'"):
        check_env(name, options(name))
    with caplog.at_level(logging.WARNING, logger="burstrl.envs.verifiers"):
        check_env(name, options(name, args={"size": 3, "anything": 1}))  # **kwargs: cannot be checked before load
    assert "['anything'] cannot be checked before it loads" in caplog.text


def test_importing_the_adapter_does_not_import_verifiers() -> None:
    code = ("import sys; from burstrl.envs.registry import env_class; env_class('verifiers:vf-sum-v1'); "
            "assert 'verifiers' not in sys.modules, sorted(m for m in sys.modules if 'verifiers' in m)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]


# ---- tasks ----
@pytest.mark.parametrize("name", ["verifiers:vf-sum-v1", "verifiers:vf-sum-legacy"])
def test_make_tasks_is_deterministic_with_ids_unique_across_draws(name: str) -> None:
    env = get_env(name, options(name, args={"num_tasks": 3}))
    first = env.make_tasks(5, seed=11)
    assert [t.id for t in first] == [t.id for t in get_env(name, options(name, args={"num_tasks": 3})).make_tasks(5, 11)]
    assert len({t.id for t in first}) == 5 and all(t.env == name and t.difficulty == 1 for t in first)
    assert len({str(t.data) for t in first[:3]}) == 3  # every row once before any repeats
    later = [t.id for seed in range(20) for t in env.make_tasks(1, seed=seed)]  # how the curriculum draws
    assert len(set(later)) == 20
    test = env.make_tasks(2, seed=11, split="test")
    assert all(t.id.startswith(f"vf-{name.split(':')[1]}-test-s11-") for t in test)
    for bad in ({"difficulty": 2}, {"split": "dev"}, {"n": -1}):
        with pytest.raises(ValueError):
            env.make_tasks(**({"n": 1, "seed": 0} | bad))
    assert env.demonstrations(first) == []


def test_v1_task_data_rebuilds_the_taskset_task() -> None:
    env = get_env("verifiers:vf-sum-v1", options("verifiers:vf-sum-v1"))
    task = env.make_tasks(1, seed=0)[0]
    stack = env.stack()
    data = stack.data_cls.model_validate(task.data)
    assert data.answer == task.data["answer"] and isinstance(stack.task_cls(data), vf.Task)


def test_building_a_legacy_env_keeps_the_process_signal_handlers() -> None:
    def mine(signum, frame) -> None:
        pass

    saved = signal.signal(signal.SIGTERM, mine)
    try:
        get_env("verifiers:vf-tool-legacy", options("verifiers:vf-tool-legacy")).make_tasks(1, seed=0)
        assert signal.getsignal(signal.SIGTERM) is mine  # verifiers' Environment installs its own exit(143)
    finally:
        signal.signal(signal.SIGTERM, saved)


# ---- the v1 seat, harness and serving ----
def test_the_seat_is_pinned_to_the_in_process_harness_and_a_local_runtime() -> None:
    config = vf_v1.resolve("vf-sum-v1", VerifiersOptions(args={"num_tasks": 2}, max_turns=3))
    assert config.agent.harness.id == vf_harness.HARNESS_ID and config.agent.runtime.type == "subprocess"
    assert config.agent.max_turns == 3 and config.taskset.num_tasks == 2 and config.retries.max_retries == 0
    assert (config.agent.model, config.agent.client, config.agent.sampling) == (None, None, None)  # the run's
    assert isinstance(vf.load_harness(config.agent.harness), vf_harness.InprocChatHarness)


def test_serving_starts_on_the_first_rollouts_loop_and_close_stops_it() -> None:
    env = get_env("verifiers:vf-sum-v1", options("verifiers:vf-sum-v1"))
    serving = env.stack().serving
    loop = asyncio.new_event_loop()
    try:
        async def two_rollouts() -> None:
            await asyncio.gather(serving.ensure(), serving.ensure())  # one start for both

        loop.run_until_complete(two_rollouts())
        held = serving.task
        assert held is not None and not held.done()
        env.close()  # the loop is idle in this thread: unwound at once
        assert held.done() and not held.cancelled()
    finally:
        loop.close()

    async def again() -> None:
        await serving.ensure()  # a new loop starts it anew
        assert serving.task is not held and not serving.task.done()
        await env.aclose()
        assert serving.task.done()

    asyncio.run(again())


# ---- outcomes ----
def trace(rewards: dict | None = None, metrics: dict | None = None, errors: tuple = (), calls: tuple = (None,)) -> vf.Trace:
    t = vf.Trace(task=vf.TraceTask(type="SumTask", data=vf.TaskData(prompt="q"), key="k", hash="h"),
                 agent=vf.AgentInfo(config=vf.AgentConfig()))
    for name, (score, weight) in (rewards or {}).items():
        t.record_reward(name, score, weight)
    t.metrics.update(metrics or {})  # None: a metric whose scoring did not run
    for error in calls:
        t.calls.append(ModelCall(model="policy-v3", endpoint="/chat/completions", time=TimeSpan(start=0, end=1),
                                 error=error))
    t.errors.extend(errors)
    t.ok = not errors
    return t


def episode(*traces: vf.Trace, errors: tuple = ()) -> vf.Episode:
    return vf.Episode(env=vf.EnvInfo(id="vf-sum-v1"), task=traces[0].task, traces=list(traces),
                      ok=all(t.ok for t in traces) and not errors, errors=list(errors))


def test_a_v1_episode_is_graded_by_its_rewards_and_metrics() -> None:
    ep = episode(trace({"correct": (1.0, 1.0), "used_tool": (0.0, 0.5)}, {"chars": 12, "flag": None}))
    out = vf_v1.outcome("vf-sum-v1", ep, client(), threshold=0.5)
    assert out.reward == 1.0 and out.passed and "reason" not in out.info
    assert out.parts == {"correct": 1.0, "used_tool": 0.0, "chars": 12.0}  # unweighted scores; None left out
    assert not vf_v1.outcome("vf-sum-v1", ep, client(), threshold=1.5).passed
    failed_call = Error(type="OverlongPromptError", message="context length", status_code=400)
    assert vf_v1.answered_calls(episode(trace(calls=(None, failed_call, None)))) == 2


@pytest.mark.parametrize(("status", "message", "raised"), [
    (503, "upstream 503: replica gone", ReplicaFailure),
    (504, "timed out", ReplicaFailure),
    (404, "upstream 404: model 'policy-v3' not found", VersionGone),
])
def test_a_fleet_failure_in_any_call_reruns_the_attempt(status: int, message: str, raised: type) -> None:
    error = Error(type="ProviderError", message=message, status_code=status)
    with pytest.raises(raised):
        vf_v1.outcome("vf-sum-v1", episode(trace(calls=(None, error), errors=(error,))), client(), 0.5)


@pytest.mark.parametrize(("error", "raised", "says"), [
    (dict(type="ProviderError", message="upstream 400: not supported: best_of", status_code=400), RuntimeError,
     "the router refused a call"),
    (dict(type="TaskError", message="task SumTask scoring: boom"), InfraError, "TaskError"),
    (dict(type="ToolsetError", message="tool server did not start"), InfraError, "ToolsetError"),
])
def test_errors_that_are_not_the_models_are_raised(error: dict, raised: type, says: str) -> None:
    error = Error(**error)
    with pytest.raises(raised, match=says):
        vf_v1.outcome("vf-sum-v1", episode(trace(errors=(error,))), client(), 0.5)
    with pytest.raises(raised, match=says):  # on the episode (a hook of the env) as on a trace
        vf_v1.outcome("vf-sum-v1", episode(trace(), errors=(error,)), client(), 0.5)


def test_an_agent_timeout_is_the_models_and_scores_zero() -> None:
    timeout = Error(type="HarnessError", message="agent timeout: rollout exceeded its 5s budget")
    out = vf_v1.outcome("vf-sum-v1", episode(trace({"correct": (1.0, 1.0)}, errors=(timeout,))), client(), 0.5)
    assert out.reward == 0.0 and not out.passed and out.info["reason"].startswith("timeout: agent timeout")


def legacy_stack():
    return get_env("verifiers:vf-sum-legacy", options("verifiers:vf-sum-legacy")).stack()


def output(reward: float, error: BaseException | None = None) -> dict:
    out = {"example_id": 3, "reward": reward, "metrics": {"correct": reward, "num_turns": 1, "note": "x"},
           "stop_condition": "max_turns_reached", "is_completed": True}
    return out | ({"error": error_data(error)} if error is not None else {})


def chained(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        raise outer from cause
    except BaseException as exc:
        return exc


def test_a_legacy_rollout_is_graded_by_its_rubric() -> None:
    stack = legacy_stack()
    out = stack.outcome(client(), output(1.0))
    assert out.passed and out.reward == 1.0 and out.parts == {"correct": 1.0, "num_turns": 1.0}
    assert out.info["stop_condition"] == "max_turns_reached" and "reason" not in out.info
    assert not stack.outcome(client(), output(0.4)).passed  # the env's own pass_threshold: 0.5
    empty = stack.outcome(client(), output(0.0, EmptyModelResponseError("Model returned no content")))
    assert empty.info["reason"].startswith("EmptyModelResponseError") and not empty.passed


def test_legacy_errors_that_are_not_the_models_are_raised() -> None:
    stack = legacy_stack()
    bad_request = openai.BadRequestError("not supported: best_of", body=None,
                                         response=httpx.Response(400, request=httpx.Request("POST", "http://x")))
    with pytest.raises(RuntimeError, match="the router refused a call"):
        stack.outcome(client(), output(0.0, chained(ModelError(), bad_request)))
    with pytest.raises(InfraError, match="SandboxError"):
        stack.outcome(client(), output(0.0, SandboxError("sandbox died")))
    c = client()
    c.failure = ReplicaFailure("call 1: 503 from the router")
    with pytest.raises(ReplicaFailure):
        stack.outcome(c, output(1.0))


def answered(n: int) -> SessionClient:
    c = client()
    c.calls = n
    return c


@pytest.mark.parametrize("error", [
    dict(type="ProviderError", message="upstream 400: tool call arguments hold special-token text", status_code=400),
    dict(type="ToolsetError", message="the tool server died"),
])
def test_a_v1_failure_after_the_models_reply_is_the_models(error: dict) -> None:
    """After a reply, what the env sends carries the model's output: a refused call or a crashed
    tool is scored 0 with its reason, never a re-run a policy could farm, never the run's end."""
    error = Error(**error)
    out = vf_v1.outcome("vf-tool-v1", episode(trace({"correct": (1.0, 1.0)}, errors=(error,))), answered(1), 0.5)
    assert out.reward == 0.0 and not out.passed and "after the model's reply" in out.info["reason"]


def test_a_legacy_failure_after_the_models_reply_is_the_models() -> None:
    stack = legacy_stack()
    bad_request = openai.BadRequestError("special-token text in tool call arguments", body=None,
                                         response=httpx.Response(400, request=httpx.Request("POST", "http://x")))
    refused = stack.outcome(answered(1), output(1.0, chained(ModelError(), bad_request)))
    crashed = stack.outcome(answered(2), output(1.0, SandboxError("the tool's sandbox died")))
    for out in (refused, crashed):
        assert out.reward == 0.0 and not out.passed and "after the model's reply" in out.info["reason"]
    assert refused.info["reason"].startswith("a call refused") and crashed.info["reason"].startswith("the environment")


# ---- the harness's tool loop, against a scripted chat server ----
class ScriptedChat(ThreadingHTTPServer):
    """An OpenAI chat endpoint that calls `calc_add` first, then answers with the tool's result."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.bodies: list[dict] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ScriptedHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        tool = next((m for m in body["messages"] if m["role"] == "tool"), None)
        if tool is None:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "calc_add", "arguments": '{"a": 10, "b": 20}'}}]}
        else:
            message = {"role": "assistant", "content": f"The sum is {tool['content']}"}
        reply = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "message": message,
                                         "finish_reason": "tool_calls" if tool is None else "stop"}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow  # verifiers starts the taskset's tool server (a Python subprocess)
def test_the_in_process_harness_runs_the_tool_loop_as_the_sessions_calls(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))
    chat = ScriptedChat()
    env = get_env("verifiers:vf-tool-v1", options("verifiers:vf-tool-v1"))
    task = next(t for t in env.make_tasks(4, seed=0) if t.data["answer"] == 30)
    c = SessionClient(None, chat.url, "sid-tools", "policy-v3", 0.7, 16, 5)  # type: ignore[arg-type]

    async def go():
        try:
            return await env.rollout(c, task)
        finally:
            await env.aclose()

    try:
        out = asyncio.run(go())
    finally:
        chat.shutdown()
    assert out.reward == 1.5 and out.parts == {"correct": 1.0, "used_tool": 1.0} and out.passed
    assert c.calls == 2 and out.info["turns"] == 2
    assert [b["tools"][0]["function"]["name"] for b in chat.bodies] == ["calc_add", "calc_add"]
    assert all(b["session_id"] == "sid-tools" and b["model"] == "policy-v3" and b["seed"] == 5
               and b["temperature"] == 0.7 and b["max_tokens"] == 16 for b in chat.bodies)
