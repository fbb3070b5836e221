"""The durable rollout store (SQLite, WAL) in the run directory.

Owns tasks, groups, rollouts and which train step consumed each. The orchestrator writes finished
groups; the trainer (rank 0) takes batches and commits consumption marks together with its
checkpoint. Both talk to it only through SQLite transactions, from different processes.
"""

from burstrl.store.store import RolloutStore, StoreError
from burstrl.store.types import BadRollout, Group, Rollout, Turn

__all__ = ["BadRollout", "Group", "Rollout", "RolloutStore", "StoreError", "Turn"]
