"""Agentic coding tasks: SWE-bench-style tasks, the toy task generator, the agent harness, grading.

Who talks to whom: the orchestrator runs `SweEnv.rollout` for each attempt; it opens a sandbox
(`burstrl.sandbox`) holding the task's repository at its base commit (no later history), runs the
agent (`agent`), which talks to the model through the router's OpenAI API with the attempt's
session id and to the sandbox through sandboxd; then it takes only what the agent committed and
grades it in a fresh sandbox (`grade`). `burstrl tasks` checks and makes task files;
`burstrl eval` evaluates checkpoints on them (`burstrl.eval`).

Modules: task (the record, JSONL loading), repo (export of the base without history, patches),
toygen + toybugs + toytemplates (procedural toy repos with SWE-smith-style injected bugs), check
(`burstrl tasks check`), testlog (unittest / pytest log parsing), agent (the minimal bash agent),
bridge (an unmodified mini-swe-agent on our sandboxes and router), grade (commit-only grading),
demos + warm (demonstration trajectories and the SFT warm start), env (the orchestrator's
Environment).
"""
