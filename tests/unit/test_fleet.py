"""The launcher's fleet, built from its options, without processes: a failed start is counted."""

from pathlib import Path

from burstrl.launcher.fleet import Fleet, FleetOptions


class _NoStarts:
    """A provider that cannot start anything."""

    def start(self, name: str, args: list[str], **kwargs: object) -> None:
        raise RuntimeError(f"no room for {name}")


def test_a_fleet_lists_no_replica_and_counts_a_failed_start(tmp_path: Path) -> None:
    events: list[tuple[str, dict]] = []
    options = FleetOptions(serve_args=["serve", "serve.toml"], router="http://127.0.0.1:9", cluster_token="c",
                           admin_token="a", run_dir=tmp_path, weights={"reserved": 1.0, "on_demand": 0.5},
                           start_timeout_s=1.0, volume=tmp_path / "adapters")
    fleet = Fleet(_NoStarts(), options, lambda kind, **fields: events.append((kind, fields)))
    assert (tmp_path / "replicas.txt").read_text() == ""
    replica = fleet.start("reserved", why="initial")
    fleet.starts[0].result(timeout=10)
    assert replica.state == "gone" and fleet.failed_starts == 1 and fleet.count("reserved") == 0
    fleet.close()
    assert events == [("replica_failed_start", {"replica": replica.name, "pool": "reserved",
                                                "detail": "no room for replica-1-reserved"})]
