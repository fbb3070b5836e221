"""Evaluation: what a run achieved, and how well a model or adapter solves an environment's tasks.

`report` reads the JSON-lines logs that the trainer (`metrics.jsonl`), the orchestrator
(`orchestrator.jsonl`) and the launcher (`fleet.jsonl`) append to a run directory and turns them
into a dashboard PNG, a markdown summary and headline figures (`burstrl report RUN_DIR`); it only
reads files. `run` runs `burstrl eval`: K attempts per task of any environment through a replica
(for swe: sandboxes and commit-only grading, `burstrl.envs.swe`; `swe_eval` keeps the old names);
`passk` (Pass@k, Chen et al.'s unbiased estimator, and per-task summaries), `compare` (paired bootstrap between two evaluations) and `swe_report` (results
JSON, markdown, PNG) turn its attempt records into figures.
"""
