"""Retire old versions on replicas, so that their memory goes to the versions still sampled.

Why only "unload": the replica decides when a version's memory is really freed. An unloaded version
stops taking new sessions at once, and one that live sessions still use is kept ('retiring') until
its last session is released: a rollout always finishes on the version it started on.
"""

from __future__ import annotations

import httpx

from burstrl.protocol.versions import VERSION_NAME
from burstrl.weights.push import TRANSIENT, PushReport, ReplicaTarget, call_with_retries, for_each_target


def unload_old(targets: list[ReplicaTarget], keep_names: set[str], retries: int = 3, backoff_s: float = 0.2,
               timeout_s: float = 30.0) -> PushReport:
    """Unload every `policy-vN` a replica lists in `/v1/models` that is not in `keep_names`.

    Other adapters (names that are not versions) are left alone. The report's `unloaded` maps each
    replica to {name: 'unloaded' | 'retiring'}; a replica that fails is reported, not raised.
    """
    def unload(target: ReplicaTarget, client: httpx.Client, report: PushReport) -> None:
        r = call_with_retries(client, "GET", "/v1/models", report, retries, backoff_s, TRANSIENT)
        names = [m["id"] for m in r.json().get("data", []) if VERSION_NAME.fullmatch(str(m.get("id")))]
        states = report.unloaded.setdefault(target.url, {})
        for name in names:
            if name not in keep_names:
                r = call_with_retries(client, "POST", "/v1/unload_lora_adapter", report, retries,
                                      backoff_s, TRANSIENT, json={"lora_name": name})
                states[name] = r.json()["status"]

    return for_each_target(targets, timeout_s, unload)
