"""Environments: tasks, the messages a model sees, and verifiable rewards.

Owns task generation and grading only; it never calls a model. The orchestrator turns a task into
chat messages (sent to the router/replicas over the OpenAI API), grades the completion text with
the task's `reward`, and writes the reward and its named parts to the rollout store. The SFT warm
start (`burstrl.trainer.sft`) uses the same tasks' demonstrations.

Modules: toy (single-turn copy-the-letters task with a dense reward, for the tiny model).
"""
