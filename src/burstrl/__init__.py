"""burstrl: asynchronous, elastic, fault-tolerant RL post-training for LLM agents.

See docs/architecture.md for the processes, the contracts between them and the package map.
"""

__version__ = "0.1.0"
