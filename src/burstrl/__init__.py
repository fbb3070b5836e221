"""burstrl: asynchronous, elastic, fault-tolerant RL post-training for LLM agents.

See DESIGN.md in the shared folder for the process roles and the contracts between them.
"""

__version__ = "0.1.0"
