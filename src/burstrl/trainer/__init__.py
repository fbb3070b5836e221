"""Training: GRPO on LoRA (loop, loss, checkpoint) and supervised warm start (sft).

The trainer reads finished groups from the rollout store (SQLite), writes checkpoints and commits
each step's consumption marks there, and publishes each version to the volume and, over HTTP(S),
to the replicas (`burstrl.weights`). Ranks talk to each other with torch.distributed.
"""
