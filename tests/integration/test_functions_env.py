"""The functions environment (issues 35, 48): one completion per attempt, graded in real sandboxes that
hold neither the tests nor the expected values (envs/functions/grade.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from burstrl.envs.functions.env import FunctionsEnv, FunctionsOptions
from burstrl.envs.swe.task import SweTask
from burstrl.orchestrator.client import SessionClient, fetch_trace, release
from tests.integration.conftest import ADMIN_TOKEN, start_server, stop_server

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")


class Scripted:
    """The model's side, scripted: the completion each call returns (what the replica would sample)."""

    def __init__(self, text: str) -> None:
        self.text, self.calls, self.prompts = text, 0, []

    async def chat(self, messages, max_tokens=None) -> str:
        raise AssertionError("a base-model environment never chats")

    async def complete(self, prompt: str, max_tokens: int | None = None, stop: list[str] | None = None) -> str:
        self.calls += 1
        self.prompts.append(prompt)
        return self.text


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    e = FunctionsEnv(FunctionsOptions(n_tasks=12, backend="namespace", max_sandboxes=4, grade_timeout_s=8),
                     tmp_path_factory.mktemp("run"))
    yield e
    e.close()


def gold_body(env: FunctionsEnv, task) -> str:
    from burstrl.envs.functions.env import _gold_body

    return _gold_body(SweTask.from_json(task.data))


def test_attempts_are_graded_by_their_cases(env: FunctionsEnv) -> None:
    [task] = env.make_tasks(1, seed=5)
    body = gold_body(env, task)
    cases = {  # completion -> (reward, passed, kind)
        "gold_then_more": (body + "\n\ndef unrelated():\n    return 0\n", 1.0, True, "ok"),
        "wrong": ("    return None\n", 0.0, False, "wrong"),
        "syntax": ("    return (\n", 0.0, False, "syntax"),
        "not_a_body": ("print('hello')\n", 0.0, False, "empty"),
        "infinite_loop": ("    while True:\n        pass\n", 0.0, False, "timeout"),
        "raises": ("    raise RuntimeError('no')\n", 0.0, False, "error"),
        # The heap walk was `suspicious` (a static scan, reward 0) while the tests ran in this process; now
        # the heap holds nothing of the grader's, so a correct body that also walks it is just correct.
        "heap_walk": ("    import gc\n    gc.get_objects()\n" + body, 1.0, True, "ok"),
        "prints": ("    print('debug')\n" + body, 1.0, True, "ok"),  # its output goes nowhere
    }

    async def go():
        return await asyncio.gather(*(env.rollout(Scripted(text), task) for text, *_ in cases.values()))

    outcomes = asyncio.run(go())
    for (name, (_, reward, passed, kind)), out in zip(cases.items(), outcomes, strict=True):
        assert (out.reward, out.passed, out.info["kind"]) == (reward, passed, kind), (name, out)
    assert outcomes[0].parts == {"resolved": 1.0, "f2p": 1.0, "tests_timeout": 0.0, "sandbox_lost": 0.0}
    assert set(outcomes[0].info["statuses"]) == set(SweTask.from_json(task.data).FAIL_TO_PASS)
    assert set(outcomes[4].info["statuses"].values()) == {"timeout"} and outcomes[4].parts["tests_timeout"] == 1.0


def test_an_expected_exception_crosses_as_its_type_name(env: FunctionsEnv, tmp_path: Path) -> None:
    """A task whose reference raises for some inputs ("Raise ValueError if x is negative"): the gold
    body passes every case (the raising ones by type name); a body that raises another type there
    fails exactly those cases."""
    from burstrl.envs.base import Task
    from burstrl.envs.functions.tasks import make_function_tasks

    swe = next(t for t in make_function_tasks(tmp_path / "set", 120, 0, "train")
               if t.extra["template"] == "checked_scale" and any("raises" in c for c in t.extra["cases"]))
    task = Task(id=swe.instance_id, env="functions", difficulty=1, data=swe.to_json())
    raising = [c["id"] for c in swe.extra["cases"] if "raises" in c]
    body = gold_body(env, task)

    async def go():
        return await asyncio.gather(*(env.rollout(Scripted(text), task) for text in
                                      (body, body.replace("raise ValueError", "raise TypeError"))))

    gold, wrong_type = asyncio.run(go())
    assert gold.reward == 1.0 and gold.passed, gold
    assert [tid for tid, s in wrong_type.info["statuses"].items() if s != "passed"] == raising, wrong_type
    assert wrong_type.reward == 1.0 - len(raising) / len(swe.extra["cases"])


def test_splits_are_generated_once_per_run_and_differ(env: FunctionsEnv) -> None:
    train = env.make_tasks(12, seed=0)
    test = env.make_tasks(12, seed=0, split="test")
    assert {t.id.split("-")[1] for t in train} == {"train"} and {t.id.split("-")[1] for t in test} == {"test"}
    assert env.make_tasks(12, seed=0) == train  # the same tasks again: made once, read back
    assert len({t.id for t in env.make_tasks(40, seed=3, split="test")}) == min(40, len(env.tasks("test")))
    assert (env.run_dir / "functions-tasks" / "train" / "tasks.jsonl").exists()


def test_a_live_replica_completes_and_captures_the_attempt(env: FunctionsEnv, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    """Through a real replica (the tiny model): one completion call, captured with its token ids, graded."""
    server = start_server(tiny_model_dir, tmp_path / "replica")
    try:
        [task] = env.make_tasks(1, seed=9)

        async def go():
            async with httpx.AsyncClient(timeout=120) as http:
                client = SessionClient(http, server.url, "fn-live-1", "base", temperature=1.0, max_tokens=16,
                                       seed=3)
                out = await env.rollout(client, task)
                trace = await fetch_trace(http, server.url, "fn-live-1", ADMIN_TOKEN)
                await release(http, server.url, "fn-live-1", ADMIN_TOKEN)
                return client, out, trace

        client, out, trace = asyncio.run(go())
        assert client.calls == 1 and len(trace["calls"]) == 1
        call = trace["calls"][0]
        assert call["prompt_ids"] and len(call["completion_ids"]) == len(call["logprobs"]) <= 48
        assert 0.0 <= out.reward <= 1.0 and "kind" in out.info
    finally:
        stop_server(server)


def test_tasks_check_flags_tests_that_reject_a_correct_variant(tmp_path: Path) -> None:
    """`tasks check` grades each task's other correct body too: a task whose tests pin one way of
    writing the answer (here a 'variant' that is really wrong stands in for such tests) is flawed."""
    from burstrl.envs.functions.tasks import attempt_patch, make_function_tasks
    from burstrl.envs.swe.check import check_tasks

    good, bad = make_function_tasks(tmp_path / "set", 2, 0, "test")
    prompt = bad.extra["prompt"]
    bad.extra["variants"] = [attempt_patch(bad.extra["file"], prompt + "    raise NotImplementedError\n",
                                           prompt + "    return None\n")]
    results = check_tasks([good, bad], tmp_path / "work")
    assert results[0].ok, results[0].problems
    assert not results[1].ok and "reject a correct variant" in " ".join(results[1].problems)
