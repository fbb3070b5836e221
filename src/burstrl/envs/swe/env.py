"""`SweEnv`: the orchestrator's Environment for coding tasks, one sandbox per attempt, graded by tests.

One attempt: a sandbox gets the task's repository at its base commit (no later history) in
/work/repo -> the agent works on it through sandboxd, talking to the model through the
orchestrator's session client (so routing, KV reuse and capture apply to every turn) -> only what
it committed is taken (`git diff BASE HEAD`, BASE the export's commit id: the `burstrl-base` tag is
the agent's to move, and a moved tag would lose its own committed work) -> a fresh sandbox grades
that patch against the task's tests. The reward is `resolved` (default), `f2p` or `strict`; its
parts go to the store, with `tampered` (forged results, see `integrity`) and `reset_files` (how
many files the patch touched that grading reset: tests, test configuration) so a run shows when a
policy starts hacking. A sandbox that fails to start, or a grading timeout the task's own tests
also hit without the patch, is an `InfraError`: the orchestrator re-runs the attempt instead of
scoring the model for it. A timeout only the patch causes is the model's (`tests_timeout`).

Who broke the sandbox decides what a lost sandbox means. Before the model acted (create, upload
of the repo, a grading sandbox that does not start or fails before the patch runs) it is infra.
After (the daemon killed, OOM-killed or hung under the model's commands, during the patch
extraction that follows them, or while the grading sandbox runs the model's code) it is the
model's doing: reward 0, parts `sandbox_lost=1`, the reason in `info["reason"]` and the log.
Never a re-run: the policy would learn to erase its failures by killing its sandbox. The one
exception is a sandbox on a node agent (`nodes_file`, `sandbox/cluster.py`) whose agent stopped
answering: the whole node went down (not what a sandbox's limited commands can do), so the attempt is an
`InfraError` and re-run elsewhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from burstrl.atomic import build_dir
from burstrl.config import SweEnvConfig
from burstrl.envs.base import ChatClient, InfraError, Outcome, Task
from burstrl.envs.swe.task import SweTask, load_tasks

REPO_DIR = "/work/repo"
PARTS = ("resolved", "f2p", "strict", "apply_ok", "submitted", "tampered", "reset_files", "tests_timeout",
         "format_ok")
log = logging.getLogger("burstrl.envs.swe")


class SweEnv:
    """Tasks from a JSONL file (or toy tasks generated into the run directory on first use)."""

    name = "swe"
    Options = SweEnvConfig  # its options: `orchestrator.swe` of a run (envs/registry.py)

    def __init__(self, cfg: SweEnvConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self._tasks: list[SweTask] | None = None
        self._pool: Any = None
        self._pool_lock = threading.Lock()  # attempts open their sandboxes in worker threads: one pool
        self._gate: asyncio.Semaphore | None = None  # made in the event loop that runs the attempts

    # ---- tasks ----
    @property
    def tasks(self) -> list[SweTask]:
        if self._tasks is None:
            path = Path(self.cfg.tasks) if self.cfg.tasks else self._toy_tasks()
            split = self.cfg.split
            self._tasks = [t for t in load_tasks(path) if t.extra.get("split", split) == split]
            if not self._tasks:
                raise ValueError(f"{path}: no task of split {split!r}")
            for t in self._tasks:
                t.disk = self.cfg.workdir_mb or t.disk
            self._check_runtimes(path)
        return self._tasks

    def _check_runtimes(self, path: Path) -> None:
        """Before any attempt: a task whose tests have nowhere to run would score 0 on every
        attempt and read as a model that fixes nothing, so the run does not start."""
        from burstrl.envs.swe.swebench import check_runtimes

        missing = check_runtimes(self._tasks or [])
        if missing:
            listed = "; ".join(f"{tid}: {why}" for tid, why in sorted(missing.items())[:5])
            raise ValueError(f"{path}: {len(missing)} task(s) have no runtime ({listed}); "
                             "see `burstrl tasks import --images`")

    @property
    def max_difficulty(self) -> int:
        return max(t.difficulty for t in self.tasks)

    def _toy_tasks(self) -> Path:
        """Generate the toy tasks once per run directory (`toy_difficulties`, the configured split).

        Made in a temp dir and renamed into place, so a crash mid-way leaves no half set behind.
        """
        from burstrl.envs.swe.task import dump_tasks
        from burstrl.envs.swe.toygen import make_task

        out = self.run_dir / "swe-tasks"

        def make(tmp: Path) -> None:
            tasks = [make_task(tmp, i, self.cfg.toy_seed, difficulty, self.cfg.split)
                     for difficulty in self.cfg.toy_difficulties for i in range(self.cfg.toy_tasks)]
            for t in tasks:  # the repos move with the directory
                t.repo = str(out.absolute() / Path(t.repo).relative_to(tmp.absolute()))
            dump_tasks(tasks, tmp / "tasks.jsonl")

        if not (out / "tasks.jsonl").exists():  # else made already (by another process: it won the race)
            build_dir(out, make, accept=lambda made: (made / "tasks.jsonl").exists(), prefix=".swe-tasks-")
        return out / "tasks.jsonl"

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        """`n` tasks of `difficulty` (the nearest easier one if none), picked deterministically by seed."""
        pool = [t for t in self.tasks if t.difficulty == difficulty] or \
            [t for t in self.tasks if t.difficulty <= difficulty] or self.tasks
        out = []
        for i in range(n):
            digest = hashlib.sha256(f"{seed}:{i}:{difficulty}".encode()).digest()
            t = pool[int.from_bytes(digest[:8], "big") % len(pool)]
            out.append(Task(id=t.instance_id, env=self.name, difficulty=t.difficulty, data=t.to_json()))
        return out

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        from burstrl.envs.swe.demos import demonstration_chat

        return [{"messages": demonstration_chat(SweTask.from_json(t.data))} for t in tasks]

    # ---- one attempt ----
    def pool(self) -> Any:
        """Local sandboxes (`SandboxPool`), or with `nodes_file` a `ClusterPool` over node agents."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = self._make_pool()
        return self._pool

    def _make_pool(self) -> Any:
        if self.cfg.nodes_file:
            from burstrl.sandbox.cluster import ClusterPool, load_nodes

            return ClusterPool(load_nodes(self.cfg.nodes_file, allow_empty=True), self.cfg.placement,
                               max_concurrent=self.cfg.max_sandboxes, dead_after_s=self.cfg.node_dead_after_s,
                               nodes_file=self.cfg.nodes_file)
        from burstrl.sandbox.pool import SandboxPool

        return SandboxPool(self.cfg.backend, max_concurrent=self.cfg.max_sandboxes)

    def close(self) -> None:
        """Close every sandbox this environment still holds (its pool's owner is the environment)."""
        if self._pool is not None:
            getattr(self._pool, "close", self._pool.close_all)()

    def _node_lost(self, *sandboxes: Any) -> bool:
        """Whether a lost sandbox went down with its node (a cluster pool's dead agent): infrastructure,
        re-run, whatever the model did. A local pool has no nodes to lose."""
        confirm = getattr(self._pool, "confirm_lost", None)
        return confirm is not None and any(confirm(s) for s in sandboxes)

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        """One attempt, at most `max_sandboxes` at once.

        Why the gate: the attempt's sandbox calls run in the event loop's worker threads. Without a
        bound, attempts beyond the pool's slots would park those threads in `pool.create` while the
        attempts holding the slots wait for a thread to run their commands: a deadlock (seen with 16
        attempts, 8 slots and 6 threads). Inside the gate every `create` finds a free slot.
        """
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.cfg.max_sandboxes)
        async with self._gate:
            return await self._rollout(client, task)

    async def _rollout(self, client: ChatClient, task: Task) -> Outcome:
        from burstrl.envs.swe.agent import AgentLimits, run_agent
        from burstrl.envs.swe.diffpolicy import DiffPolicy
        from burstrl.envs.swe.grade import base_tar, grade, reward_of

        swe = SweTask.from_json(task.data)
        sandbox = await asyncio.to_thread(self._open, swe)
        try:
            # export_base is deterministic (fixed identity and dates): this is the commit in the sandbox.
            base_id = (await asyncio.to_thread(base_tar, swe))[0]
            limits = AgentLimits(max_turns=self.cfg.max_turns, max_tokens_per_call=self.cfg.max_tokens_per_call,
                                 command_timeout_s=self.cfg.command_timeout_s)
            result = await run_agent(client, sandbox, swe, limits)
            patch, failure = await self._patch(sandbox, result, base_id)
        finally:
            await asyncio.to_thread(sandbox.close)
        info = {"turns": result.turns, "exit_reason": result.exit_reason, "patch_bytes": len(patch)}
        if failure:
            if await asyncio.to_thread(self._node_lost, sandbox):
                raise InfraError(f"sandbox for {swe.instance_id}: its node died ({failure})")
            return self._failed(swe, failure, info, submitted=result.submitted)
        pool = self.pool()
        grader = pool.tracker() if hasattr(pool, "tracker") else pool
        policy = DiffPolicy(tuple(self.cfg.diff_allow), tuple(self.cfg.diff_deny))
        graded = await asyncio.to_thread(grade, swe, patch, grader, timeout_s=self.cfg.grade_timeout_s, policy=policy,
                                         suspicious=self.cfg.suspicious, seal=self.cfg.seal)
        if getattr(graded, "infra_error", None):
            raise InfraError(f"grading {swe.instance_id}: {graded.infra_error}")
        if getattr(graded, "model_error", None) and grader is not pool and await asyncio.to_thread(grader.lost):
            raise InfraError(f"grading {swe.instance_id}: its node died ({graded.model_error})")
        if getattr(graded, "model_error", None):
            return self._failed(swe, f"sandbox_lost: grading: {graded.model_error}", info, submitted=result.submitted,
                                apply_ok=graded.apply_ok)
        parts = {"resolved": float(graded.resolved), "f2p": float(graded.f2p), "strict": float(graded.strict),
                 "apply_ok": float(graded.apply_ok), "submitted": float(result.submitted), "sandbox_lost": 0.0,
                 "tampered": float(bool(graded.tampered)), "reset_files": float(len(graded.reset_files)),
                 "tests_timeout": float(graded.reason.startswith("tests_timeout"))}
        for key in ("reset_files", "suspicious"):
            if getattr(graded, key):
                info[key] = list(getattr(graded, key))
        if graded.reason:
            log.info("attempt at %s scores 0: %s", swe.instance_id, graded.reason)
            info["reason"] = graded.reason
        parts["format_ok"] = float(result.submitted and result.format_errors == 0)
        shaped = self.cfg.format_reward * parts["format_ok"] * (not graded.tampered)
        return Outcome(reward=reward_of(graded, self.cfg.reward) + shaped, parts=parts,
                       passed=bool(graded.resolved), info=info)

    @staticmethod
    async def _patch(sandbox: Any, result: Any, base_id: str) -> tuple[str, str]:
        """(the committed patch, "") or ("", why there is none to grade) once the model has acted.

        Any sandbox error here follows the model's commands: a background process it left killed
        the daemon (`sandbox_lost`), or it committed something the daemon refuses to hand back.
        """
        from burstrl.envs.swe.agent import is_sandbox_lost
        from burstrl.envs.swe.grade import extract_patch
        from burstrl.sandbox.client import SandboxError

        if result.exit_reason == "sandbox_lost":
            return "", f"sandbox_lost: {result.sandbox_error}"
        try:
            return await asyncio.to_thread(extract_patch, sandbox, REPO_DIR, base_id), ""
        except (SandboxError, OSError) as exc:
            kind = "sandbox_lost" if is_sandbox_lost(exc) else "patch_unreadable"
            return "", f"{kind}: after the agent's commands: {type(exc).__name__}: {exc}"

    @staticmethod
    def _failed(swe: SweTask, reason: str, info: dict[str, Any], submitted: bool, apply_ok: bool = False) -> Outcome:
        """A model failure that left nothing to grade: reward 0 with the reason, never a re-run."""
        log.info("attempt at %s scores 0: %s", swe.instance_id, reason)
        parts = dict.fromkeys(PARTS, 0.0) | {"submitted": float(submitted), "apply_ok": float(apply_ok),
                                             "sandbox_lost": float(reason.startswith("sandbox_lost"))}
        return Outcome(reward=0.0, parts=parts, passed=False, info={**info, "reason": reason})

    def _open(self, swe: SweTask) -> Any:
        """A sandbox with the task's base in /work/repo (InfraError if it cannot be made).

        The base is the grader's export (`base_tar`, cached per task): one export per task, and the
        commit id the patch is later taken against is the one in the sandbox by construction."""
        from burstrl.envs.swe.grade import base_tar
        from burstrl.sandbox.backends import SandboxSpec

        spec = SandboxSpec(image=Path(swe.image) if swe.image else None, cpu_limit=swe.cpu,
                           memory_limit_mb=swe.memory, workdir_mb=swe.disk)
        repo_tar = base_tar(swe)[1]  # a repository that cannot be exported is bad task input: raises
        try:
            sandbox = self.pool().create(spec, timeout=600)
        except Exception as exc:  # sandbox infrastructure, not the model: the attempt is re-run
            raise InfraError(f"sandbox for {swe.instance_id}: {type(exc).__name__}: {exc}") from None
        try:
            self._upload(sandbox, repo_tar, swe)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    @staticmethod
    def _upload(sandbox: Any, repo: bytes, swe: SweTask) -> None:
        """Upload the base; a sandbox failing here failed before the model acted: infra, re-run."""
        from burstrl.sandbox.client import SandboxError

        try:
            sandbox.upload(repo, REPO_DIR)
        except (SandboxError, OSError) as exc:
            raise InfraError(f"upload to the sandbox for {swe.instance_id}: {type(exc).__name__}: {exc}") from None
