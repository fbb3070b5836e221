"""Policy version names: `base` is the base model (version 0), `policy-vN` is the trainer's step N.

Why here: the trainer names what it publishes, the volume names its directories, replicas serve
the names, the router orders them and the orchestrator reads the number back from them; all of
them must spell and parse the name the same way.
"""

from __future__ import annotations

import re

BASE = "base"
PREFIX = "policy-v"
# a version name with a canonical number (v7, not v007), used with fullmatch: the volume's directories
VERSION_NAME = re.compile(r"policy-v(0|[1-9][0-9]*)")


def version_name(version: int) -> str:
    """`policy-v{version}`."""
    return f"{PREFIX}{version}"


def version_number(name: str) -> int:
    """`base` -> 0, `policy-vN` -> N; ValueError for any other name."""
    if name == BASE:
        return 0
    if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return int(name[len(PREFIX):])
    raise ValueError(f"not a policy version name: {name!r}")


def version_key(version: str) -> tuple[int, str]:
    """Order versions by their trailing number (`policy-v12` > `policy-v9`), then by name."""
    match = re.search(r"(\d+)$", version)
    return (int(match.group(1)) if match else -1, version)
