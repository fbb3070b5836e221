"""Evaluation: what a run achieved, read back from its run directory.

This package owns the offline views of a run: `report` reads the JSON-lines logs that the trainer
(`metrics.jsonl`), the orchestrator (`orchestrator.jsonl`) and the launcher (`fleet.jsonl`) append
to the run directory and turns them into a dashboard PNG, a markdown summary and a dict of headline
figures for tests and benchmarks (`burstrl report RUN_DIR`). It talks to no process: it only reads
files, so it works on a live run, a finished one, or one copied off a cluster. Later: pass@k and
partial-credit evaluation of a policy version on held-out tasks.
"""
