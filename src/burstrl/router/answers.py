"""A replica's answers to the router's scrapes (`/v1/loads`, `/v1/models`), checked against a schema.

Why a schema and not `dict.get` with defaults: a replica is a peer, not part of the router, and its
answer feeds every placement. A session reported with 10**400 tokens made the size model raise
OverflowError on every placement (every new session a 500); `num_used_tokens: 1e999` or an answer
nested 100k levels deep raised outside what the scrape caught and ended the scrape loop (issue 36).
So an answer is parsed with its depth bounded, every field the router uses is checked (type,
finite, within bounds; lists bounded in length) and copied into a fresh dict holding only those
fields, and anything else is a `BadAnswer` that names the field: the replica is marked bad with
that reason and nothing it said is used. Missing fields keep the defaults the registry always
assumed (an SGLang-shaped replica reports fewer of them).
"""

from __future__ import annotations

import json
import math
from typing import Any

from burstrl.protocol.tenants import SCOPED_SESSION_ID
from burstrl.router.loads import MAX_SUMMARY_BLOCKS

MAX_TOKENS = 1 << 53  # a token count beyond this is not a KV size (and float math on it loses integers)
MAX_COUNT = 1 << 63  # running counters (evictions, hit tokens): any int64
MAX_HASH = 1 << 64  # prefix block keys are 63-bit (protocol.blocks); anything in uint64 is accepted
MAX_LISTED_SESSIONS = 1_000_000  # as many as the router remembers (registry.MAX_SESSIONS)
MAX_VERSIONS = 4096  # versions (adapters) one replica serves
MAX_NAME_CHARS = 256  # a version or model name
TOKEN_FIELDS = ("num_used_tokens", "max_total_num_tokens")
COUNT_FIELDS = ("num_running_reqs", "num_waiting_reqs", "thrash", "evictions",
                "prefix_cache_hit_tokens", "prefix_cache_queries_tokens")


class BadAnswer(ValueError):
    """A scrape answer the router will not trust; the message names the field and why."""


def parse(raw: bytes, what: str) -> Any:
    """JSON of an answer; nested deeper than the interpreter's stack or not JSON is a BadAnswer."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadAnswer(f"{what}: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise BadAnswer(f"{what}: not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


def check_answers(loads_raw: bytes, models_raw: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both answers of one scrape parsed and checked (`check_loads`, `check_models`).

    CPU work proportional to the answers (sessions, block keys): the router runs it off the event loop.
    """
    return check_loads(parse(loads_raw, "/v1/loads")), check_models(parse(models_raw, "/v1/models"))


def check_loads(data: Any) -> dict[str, Any]:
    """The `/v1/loads` fields the registry reads, checked and copied; `sessions` only if the answer had it
    (a replica that lists none to the router is warned about, not treated as empty)."""
    obj = _object(data, "/v1/loads")
    out: dict[str, Any] = {name: _int(obj.get(name, 0), name, MAX_TOKENS) for name in TOKEN_FIELDS}
    out.update({name: _int(obj.get(name, 0), name, MAX_COUNT) for name in COUNT_FIELDS})
    out["cache_hit_rate"] = _fraction(obj.get("cache_hit_rate", 0.0), "cache_hit_rate")
    out["versions"] = _names(obj.get("versions", []), "versions")
    if "sessions" in obj:
        out["sessions"] = _sessions(obj["sessions"])
    if "prefix_blocks" in obj:
        out["prefix_blocks"] = {"hashes": _hashes(obj["prefix_blocks"])}
    if obj.get("kv_window") is not None:
        window = _object(obj["kv_window"], "kv_window")
        out["kv_window"] = (_int(window.get("tokens"), "kv_window.tokens", MAX_TOKENS),
                            _fraction(window.get("fraction"), "kv_window.fraction"))
    return out


def check_models(data: Any) -> dict[str, Any]:
    """`/v1/models` as `{"data": [{"id": name}, ...]}` with every name checked."""
    entries = _list(_object(data, "/v1/models").get("data", []), "data", MAX_VERSIONS)
    return {"data": [{"id": _name(_object(e, f"data[{i}]").get("id"), f"data[{i}].id")}
                     for i, e in enumerate(entries)]}


def _sessions(value: Any) -> list[dict[str, Any]]:
    out = []
    for i, s in enumerate(_list(value, "sessions", MAX_LISTED_SESSIONS)):
        s = _object(s, f"sessions[{i}]")
        sid = s.get("session_id")
        if not isinstance(sid, str) or not SCOPED_SESSION_ID.fullmatch(sid):  # a tenant's: `<tenant>~<sid>`
            raise BadAnswer(f"sessions[{i}].session_id must be 1-128 characters of [A-Za-z0-9._:@/-], "
                            "optionally in a tenant's namespace (`<tenant>~`)")
        busy = s.get("busy", False)
        if not isinstance(busy, bool):
            raise BadAnswer(f"sessions[{i}].busy must be a boolean")
        version = s.get("version", "")
        out.append({"session_id": sid, "busy": busy,
                    "version": _name(version, f"sessions[{i}].version") if version != "" else "",
                    "tokens": _int(s.get("tokens", 0), f"sessions[{i}].tokens", MAX_TOKENS),
                    "context_tokens": _int(s.get("context_tokens", 0), f"sessions[{i}].context_tokens", MAX_TOKENS)})
    return out


def _hashes(value: Any) -> list[int]:
    hashes = _list(_object(value, "prefix_blocks").get("hashes", []), "prefix_blocks.hashes", MAX_SUMMARY_BLOCKS)
    for h in hashes:
        if type(h) is not int or not 0 <= h < MAX_HASH:
            raise BadAnswer(f"prefix_blocks.hashes holds {_show(h)}, not a block key in [0, 2^64)")
    return hashes


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadAnswer(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str, most: int) -> list[Any]:
    if not isinstance(value, list):
        raise BadAnswer(f"{where} must be a list, got {type(value).__name__}")
    if len(value) > most:
        raise BadAnswer(f"{where} has {len(value)} entries, more than {most}")
    return value


def _names(value: Any, where: str) -> list[str]:
    return [_name(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where, MAX_VERSIONS))]


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise BadAnswer(f"{where} must be a string of 1-{MAX_NAME_CHARS} characters")
    return value


def _int(value: Any, where: str, most: int) -> int:
    """A count: a finite number in [0, most] (an integral float such as 12.0 is taken as 12)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadAnswer(f"{where} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise BadAnswer(f"{where}={_show(value)} is not a finite integer")
    if not 0 <= value <= most:
        raise BadAnswer(f"{where}={_show(value)} is outside [0, {most}]")
    return int(value)


def _fraction(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise BadAnswer(f"{where}={_show(value)} must be a number in [0, 1]")
    return float(value)


def _show(value: Any) -> str:
    """A value for an error message, never long (an int of 400 digits, a huge string)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
