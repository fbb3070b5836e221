"""`FunctionsEnv`: write one Python function from its def line and docstring; graded by hidden tests.

One attempt is one completion call (no chat template: made for base models): the prompt is the
task's def line and docstring, the model writes the body, stopped at the end of the function (stop
strings, then the first line that is not indented). The module (prompt + body) is graded by
`envs/functions/grade.py`: it runs in a fresh sandbox that holds neither the tests nor the expected
values, one forked call per case, and only plain data comes back to be compared here. A syntax
error, an exception, an exit or an infinite loop fails the cases it hits: the model's 0 for those.
Reward = the share of the cases passed (`f2p`), `resolved` = all of them. A grading sandbox that
could not start (infra) is an `InfraError`: the attempt is re-run, never scored.

Options (`[orchestrator.env.functions]`): the task set (generated into RUN_DIR/functions-tasks on
first use, or a `tasks make-functions` output), its split, sandboxes, limits.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from burstrl.atomic import build_dir
from burstrl.config import Section
from burstrl.envs.base import ChatClient, InfraError, Outcome, Task
from burstrl.envs.functions.cases import task_cases
from burstrl.envs.functions.grade import GRADE_TIMEOUT_S, SYNTAX, FunctionResult
from burstrl.envs.swe.task import SweTask, load_tasks

STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n@", "\nassert ", "\n\n\n"]
PARTS = ("resolved", "f2p", "tests_timeout", "sandbox_lost")


class FunctionsOptions(Section):
    tasks: str = Field("", description="A `burstrl tasks make-functions` directory (its tasks.jsonl); empty = "
                       "generate `n_tasks` of each split into RUN_DIR/functions-tasks on first use.")
    n_tasks: int = Field(300, ge=1, description="Tasks generated per split when `tasks` is empty.")
    seed: int = Field(0, description="Seed of the generated tasks.")
    split: Literal["train", "test"] = Field("train", description="The split attempts are drawn from.")
    max_tokens: int = Field(48, ge=1, description="max_tokens of the completion (the function body).")
    backend: Literal["auto", "namespace", "oci", "runsc"] = Field("auto", description="Sandbox backend of grading.")
    max_sandboxes: int = Field(8, ge=1, description="Grading sandboxes alive at once.")
    grade_timeout_s: float = Field(GRADE_TIMEOUT_S, gt=0, description="Time limit of one attempt's run; each case may "
                                   "take 1/(2(n+1)) of it (n cases), so all of them at their limit end in half.")
    suspicious: str = Field("", exclude=True, description="Gone: the static scan of the body. The candidate now "
                            "runs apart from the tests and expected values, so nothing it calls can forge a pass; "
                            "setting it is an error that says so.")

    @field_validator("suspicious")
    @classmethod
    def _gone(cls, value: str) -> str:
        if value:
            raise ValueError("orchestrator.env.functions.suspicious is no longer an option: functions attempts run "
                             "in a sandbox that holds neither the tests nor the expected values, and only plain data "
                             "comes back (envs/functions/grade.py), so no static scan is needed; remove the key")
        return value


class FunctionsEnv:
    """One-function Python problems (`envs/functions/templates.py`), completion style."""

    name = "functions"
    max_difficulty = 1
    Options = FunctionsOptions

    def __init__(self, cfg: FunctionsOptions | None = None, run_dir: Path | str = ".") -> None:
        self.cfg, self.run_dir = cfg or FunctionsOptions(), Path(run_dir)
        self._tasks: dict[str, list[SweTask]] = {}
        self._pool: Any = None
        self._lock = threading.Lock()

    # ---- tasks ----
    def tasks(self, split: str) -> list[SweTask]:
        if split not in self._tasks:
            path = Path(self.cfg.tasks) / "tasks.jsonl" if self.cfg.tasks else self._generated(split)
            tasks = [t for t in load_tasks(path) if t.extra.get("split") == split]
            if not tasks:
                raise ValueError(f"{path}: no functions task of split {split!r}")
            for t in tasks:  # a set made by an older burstrl has no cases: say so before any attempt
                task_cases(t)
            self._tasks[split] = tasks
        return self._tasks[split]

    def _generated(self, split: str) -> Path:
        """The split's tasks, made once per run directory (temp dir renamed into place)."""
        from burstrl.envs.functions.tasks import make_function_tasks

        out = self.run_dir / "functions-tasks" / split

        def make(tmp: Path) -> None:
            tasks = make_function_tasks(tmp, self.cfg.n_tasks, self.cfg.seed, split)
            for t in tasks:  # the repository moves with the directory
                t.repo = str(out.absolute() / Path(t.repo).relative_to(tmp.absolute()))
            from burstrl.envs.swe.task import dump_tasks

            dump_tasks(tasks, tmp / "tasks.jsonl")

        if not (out / "tasks.jsonl").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            build_dir(out, make, accept=lambda made: (made / "tasks.jsonl").exists(), prefix=".functions-")
        return out / "tasks.jsonl"

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "") -> list[Task]:
        """`n` tasks of the split (`split`, else the configured one), picked deterministically by seed:
        a seeded order of the whole split, so no task repeats before every task came once (an eval of
        40 tasks drawn independently held 36 distinct ones)."""
        pool = self.tasks(split or self.cfg.split)
        order = sorted(range(len(pool)), key=lambda j: hashlib.sha256(f"{seed}:{j}".encode()).digest())
        picked = [pool[order[i % len(pool)]] for i in range(n)]
        return [Task(id=t.instance_id, env=self.name, difficulty=1, data=t.to_json()) for t in picked]

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        """Not used for base models (no chat template); the gold body as a one-turn chat for completeness."""
        out = []
        for t in tasks:
            swe = SweTask.from_json(t.data)
            body = _gold_body(swe)
            out.append({"messages": [{"role": "user", "content": swe.extra["prompt"]},
                                     {"role": "assistant", "content": body}]})
        return out

    # ---- one attempt ----
    def pool(self) -> Any:
        with self._lock:
            if self._pool is None:
                from burstrl.sandbox.pool import SandboxPool

                self._pool = SandboxPool(self.cfg.backend, max_concurrent=self.cfg.max_sandboxes)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close_all()

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        from burstrl.envs.functions.grade import grade, reward

        swe = SweTask.from_json(task.data)
        prompt = swe.extra["prompt"]
        text = await client.complete(prompt, max_tokens=self.cfg.max_tokens, stop=STOP)
        body = function_body(text)
        r = await asyncio.to_thread(grade, swe, prompt + body, self.pool(), timeout_s=self.cfg.grade_timeout_s)
        if r.infra_error:
            raise InfraError(f"grading {swe.instance_id}: {r.infra_error}")
        timeouts = r.timed_out or any(s == "timeout" for s in r.statuses.values())
        parts = {"resolved": float(r.resolved), "f2p": r.f2p, "tests_timeout": float(timeouts),
                 "sandbox_lost": float(bool(r.model_error))}
        reason = r.reason or (f"sandbox_lost: grading: {r.model_error}" if r.model_error else "")
        info: dict[str, Any] = {"body": body[:2000], "statuses": r.statuses, "kind": failure_kind(r, body)}
        if reason:
            info["reason"] = reason
        return Outcome(reward=reward(r), parts=parts, passed=r.resolved, info=info)


def function_body(text: str) -> str:
    """The completion up to the end of the function: lines until the first non-empty line that is
    not indented (the model went on to write something else), with a final newline."""
    kept: list[str] = []
    for line in text.split("\n"):
        if line.strip() and not line[:1].isspace():
            break
        kept.append(line)
    body = "\n".join(kept).rstrip()
    return body + "\n" if body else ""


def failure_kind(r: FunctionResult, body: str) -> str:
    """What went wrong, for decomposing what RL learned: ok, empty, syntax, timeout, error, wrong, partial
    (or the kind of a named failure: runner_lost, sandbox_lost)."""
    if r.resolved:
        return "ok"
    if not body.strip():
        return "empty"
    if r.import_error:
        return "syntax" if r.import_error in SYNTAX else "error"
    if r.timed_out or r.reason.startswith("tests_timeout"):
        return "timeout"
    if r.model_error:
        return "sandbox_lost"
    if r.reason:
        return r.reason.split(":", 1)[0]
    if r.f2p > 0:
        return "partial"
    statuses = list(r.statuses.values())
    if "timeout" in statuses:
        return "timeout"
    if statuses and all(s == "error" for s in statuses):
        return "error"
    return "wrong"


def _gold_body(swe: SweTask) -> str:
    from burstrl.envs.functions.grade import stub_source
    from burstrl.envs.functions.tasks import apply_patch

    return apply_patch(stub_source(swe), swe.patch).removeprefix(swe.extra["prompt"])
