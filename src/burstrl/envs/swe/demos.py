"""Warm-start trajectories for coding tasks: the agent's conversation, written by a known fix.

Why real observations: a demonstration teaches the model what to say after what it sees, so each
command of the fix is run (in an export of the task's base, on the host: the commands only touch
the repo) and its actual output, formatted exactly as the agent formats observations, becomes the
next user message. Any task with a gold patch gets one through `patch_commands` (apply the gold
patch, commit); toy tasks use the generator's step-by-step fix (`toygen.demonstration_commands`).
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from burstrl.envs.swe.agent import GIT_ENV, SUBMIT_COMMAND, format_observation, initial_messages
from burstrl.envs.swe.repo import export_base
from burstrl.envs.swe.task import SweTask


@dataclass
class _Result:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False


def patch_commands(task: SweTask) -> list[str]:
    """Commands that apply a task's gold patch and commit it (for tasks without a step-by-step fix)."""
    return [f"git apply <<'PATCH'\n{task.patch}PATCH", "git commit -q -am fix"]


def fix_commands(task: SweTask) -> list[str]:
    if "fix" in task.extra and "bugs" in task.extra:
        from burstrl.envs.swe.toygen import demonstration_commands

        return demonstration_commands(task)
    if not task.patch:
        raise ValueError(f"task {task.instance_id} has neither a step-by-step fix nor a gold patch")
    return patch_commands(task)


def demonstration_chat(task: SweTask, max_output_chars: int = 2000,
                       commands: list[str] | None = None) -> list[dict[str, str]]:
    """The full agent conversation of a correct attempt (or of `commands`), ending with the submit command."""
    messages = initial_messages(task)
    with tempfile.TemporaryDirectory(prefix="swe-demo-") as tmp:
        repo = Path(tmp) / "repo"
        export_base(task, repo)
        for command in fix_commands(task) if commands is None else commands:
            messages.append({"role": "assistant", "content": f"```bash\n{command}\n```"})
            r = subprocess.run(["bash", "-c", command], cwd=repo, capture_output=True, text=True, timeout=120,
                               env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmp, **GIT_ENV})
            messages.append({"role": "user", "content": format_observation(
                _Result(r.stdout, r.stderr, r.returncode), max_output_chars)})
        if not messages[-2]["content"].rstrip("`\n").endswith(SUBMIT_COMMAND):  # not submitted by its last command
            messages.append({"role": "assistant", "content": f"```bash\n{SUBMIT_COMMAND}\n```"})
    return messages


def write_demonstrations(tasks: list[SweTask], path: str | Path) -> Path:
    """One `{"messages": [...]}` per task, the format `burstrl sft --data` reads."""
    from burstrl.envs.toy import write_jsonl

    return write_jsonl([{"messages": demonstration_chat(t)} for t in tasks], path)

