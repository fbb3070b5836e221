"""An OpenEnv environment for trying the "openenv:<url>" adapter: add two numbers, up to 3 tries.

- `game`: the rules, plain Python (no openenv import);
- `server`: the environment written with openenv's own `Environment`, `Rubric` and `create_app`,
  served by uvicorn (`python -m examples.openenv_envs.arith.server --port 8000` from the repository
  root, which needs `pip install 'burstrl[openenv]'`);
- `native`: the same game as a native burstrl environment with the same prompts and parsing, the
  baseline `benchmarks/ecosystem_overhead.py` measures the adapter against.

Train on it with `[orchestrator.envs] "openenv:http://127.0.0.1:8000" = 1.0`, or evaluate with
`burstrl eval --model DIR --env openenv:http://127.0.0.1:8000 --n 8`.
"""
