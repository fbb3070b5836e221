"""Retire old versions on replicas, so that their memory goes to the versions still sampled.

Why only "unload": the replica decides when a version's memory is really freed. An unloaded version
stops taking new sessions at once, and one that live sessions still use is kept ('retiring') until
its last session is released: a rollout always finishes on the version it started on.
"""

from __future__ import annotations

import time

from burstrl.weights.push import (TRANSIENT, PushReport, ReplicaTarget, TargetFailed, call_with_retries,
                                  in_parallel)
from burstrl.weights.volume import VERSION_DIR


def unload_old(targets: list[ReplicaTarget], keep_names: set[str], retries: int = 3, backoff_s: float = 0.2,
               timeout_s: float = 30.0) -> PushReport:
    """Unload every `policy-vN` a replica lists in `/v1/models` that is not in `keep_names`.

    Other adapters (names that are not versions) are left alone. The report's `unloaded` maps each
    replica to {name: 'unloaded' | 'retiring'}; a replica that fails is reported, not raised.
    """
    start = time.monotonic()

    def one(target: ReplicaTarget) -> PushReport:
        report = PushReport()
        with target.client(timeout_s) as client:
            try:
                r = call_with_retries(client, "GET", "/v1/models", report, retries, backoff_s, TRANSIENT)
                names = [m["id"] for m in r.json().get("data", []) if VERSION_DIR.fullmatch(str(m.get("id")))]
                states = report.unloaded.setdefault(target.url, {})
                for name in names:
                    if name in keep_names:
                        continue
                    r = call_with_retries(client, "POST", "/v1/unload_lora_adapter", report, retries,
                                          backoff_s, TRANSIENT, json={"lora_name": name})
                    states[name] = r.json()["status"]
            except TargetFailed as exc:
                report.failed[target.url] = str(exc)
                return report
        report.ok.append(target.url)
        return report

    report = PushReport.merge(in_parallel(one, targets))
    report.seconds = time.monotonic() - start
    return report
