"""The orchestrator: curriculum, group scheduling, rollout runners, autoscaler. Talks to the router over the OpenAI API (httpx) and writes finished groups to the rollout store (SQLite)."""
