"""The minimal bash agent against real sandboxes; the model's side is a scripted ChatClient (input)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from burstrl.envs.swe.agent import (
    REPO_DIR,
    SUBMIT_COMMAND,
    SUBMIT_SENTINEL,
    AgentLimits,
    cap_output,
    extract_commands,
    fit_context,
    is_submission,
    run_agent,
)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

class ScriptedClient:
    """Replies from a list (the last one repeats) and records every conversation it was sent."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.calls = 0
        self.seen: list[list[dict[str, str]]] = []
        self.max_tokens: list[int | None] = []

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        self.seen.append([dict(m) for m in messages])
        self.max_tokens.append(max_tokens)
        reply = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        return reply


def bash(cmd: str, text: str = "") -> str:
    return f"{text}\n```bash\n{cmd}\n```\n"


def run(client: ScriptedClient, sb, task, **limits) -> object:
    return asyncio.run(run_agent(client, sb, task, AgentLimits(**limits)))


def test_extract_one_none_several_and_other_languages():
    assert extract_commands(bash("ls -la", "Let me look.")) == ["ls -la"]
    assert extract_commands("no code here") == []
    assert extract_commands(bash("ls") + bash("pwd")) == ["ls", "pwd"]
    assert extract_commands("```python\nprint(1)\n```\n```\nls\n```\n```sh\nls\n```") == []
    assert extract_commands("```bash\nunterminated") == []
    assert extract_commands("```bash\nsed -i 's/a/b/' f.py && \\\n  cat f.py\n```") == [
        "sed -i 's/a/b/' f.py && \\\n  cat f.py"]


def test_submission_detection():
    assert is_submission(SUBMIT_COMMAND, SUBMIT_SENTINEL + "\n", 0)
    assert is_submission("git commit -qam fix; echo " + SUBMIT_SENTINEL, f"\n{SUBMIT_SENTINEL}\n", 0)
    assert not is_submission("git commit -am fix && echo " + SUBMIT_SENTINEL, f"[main 1a2b] fix\n{SUBMIT_SENTINEL}", 0)
    assert not is_submission("false; echo " + SUBMIT_SENTINEL, SUBMIT_SENTINEL, 1)
    assert not is_submission("echo hi", "hi\n", 0)


def test_cap_output_keeps_head_and_tail():
    text = "HEAD" + "x" * 5000 + "TAIL"
    capped = cap_output(text, 200)
    assert capped.startswith("HEAD") and capped.endswith("TAIL")
    assert "4808 characters elided" in capped and len(capped) < 300
    assert cap_output("short", 200) == "short"


def test_fit_context_elides_oldest_observations_only():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for i in range(6):
        msgs += [{"role": "assistant", "content": f"reply {i}"}, {"role": "user", "content": str(i) * 1000}]
    assert not fit_context([dict(m) for m in msgs], 10_000)
    assert fit_context(msgs, 5000)
    assert sum(len(m["content"]) for m in msgs) <= 2500
    assert msgs[1]["content"] == "task" and msgs[-1]["content"] == "5" * 1000
    assert all(m["content"] == f"reply {i}" for i, m in enumerate(msgs[2::2]))
    assert "elided" in msgs[3]["content"]


@needs_bwrap
def test_agent_fixes_commits_and_submits(calc_sandbox, calc_task):
    client = ScriptedClient([bash("cat calc.py", "Look first."), bash("sed -i 's/a - b/a + b/' calc.py"),
                             bash('git commit -qam "fix add"'), bash(SUBMIT_COMMAND)])
    result = run(client, calc_sandbox, calc_task)
    assert result.submitted and result.exit_reason == "submitted" and result.turns == 4
    assert calc_sandbox.exec("git log --format=%s", timeout=10, cwd=REPO_DIR).stdout.split("\n")[:2] == ["fix add", "base"]
    assert "a + b" in calc_sandbox.exec("git show HEAD:calc.py", timeout=10, cwd=REPO_DIR).stdout
    # The transcript: one record per turn, with the command, its exit code and the observation.
    first = result.transcript[0]
    assert {"turn", "reply", "command", "exit_code", "observation", "format_error", "submitted"} <= set(first)
    assert first["command"] == "cat calc.py" and first["exit_code"] == 0 and "a - b" in first["observation"]
    assert [t["submitted"] for t in result.transcript] == [False, False, False, True]
    # Every call's messages extend the previous call's by the reply and its observation (token continuity).
    for before, after in zip(client.seen, client.seen[1:], strict=False):
        assert after[:len(before)] == before and len(after) == len(before) + 2
        assert after[len(before)]["role"] == "assistant" and after[-1]["role"] == "user"
    assert client.seen[0][0]["role"] == "system" and "add(2, 3)" in client.seen[0][1]["content"]
    assert client.max_tokens == [256] * 4


@needs_bwrap
def test_format_errors_are_told_to_the_model_and_capped(calc_sandbox, calc_task):
    client = ScriptedClient(["I think the bug is in calc.py.", bash("ls") + bash("pwd")])
    result = run(client, calc_sandbox, calc_task, max_format_errors=3)
    assert result.exit_reason == "format_errors" and not result.submitted and result.turns == 3
    assert result.format_errors == 3 and all(t["command"] is None for t in result.transcript)
    assert "found 0" in client.seen[1][-1]["content"] and "found 2" in client.seen[2][-1]["content"]


@needs_bwrap
def test_turn_limit_and_capped_observation(calc_sandbox, calc_task):
    client = ScriptedClient([bash("python3 -c \"print('x' * 10000)\"; echo done >&2")])
    result = run(client, calc_sandbox, calc_task, max_turns=3, max_output_chars=500)
    assert result.exit_reason == "max_turns" and result.turns == 3
    obs = result.transcript[0]["observation"]
    assert obs.startswith("exit code: 0") and "characters elided" in obs and obs.endswith("done")
    assert len(obs) < 600


@needs_bwrap
def test_command_timeout_and_attempt_timeout(calc_sandbox, calc_task):
    client = ScriptedClient([bash("sleep 10")])
    result = run(client, calc_sandbox, calc_task, command_timeout_s=1, max_seconds=2.5)
    assert result.exit_reason == "timeout" and result.turns >= 1
    assert result.transcript[0]["timed_out"] and "(timed out)" in result.transcript[0]["observation"]
    assert result.seconds < 8


@needs_bwrap
def test_token_budget(calc_sandbox, calc_task):
    client = ScriptedClient([bash("true", "thinking " * 60)])
    result = run(client, calc_sandbox, calc_task, max_total_tokens=300, max_tokens_per_call=256)
    assert result.exit_reason == "max_tokens" and result.turns == 2
    assert client.max_tokens[0] == 256 and client.max_tokens[1] < 256
