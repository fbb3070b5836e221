from burstrl.config import AutoscaleConfig
from burstrl.orchestrator.autoscaler import FleetSignals, decide, wait_fraction

CFG = AutoscaleConfig(enabled=True, min_on_demand=1, max_on_demand=3, wait_fraction=0.3, overflow_batches=2.0)


def signals(wait: float | None, buffered: int, on_demand: int) -> FleetSignals:
    return FleetSignals(wait_fraction=wait, buffered_groups=buffered, batch_groups=4, on_demand=on_demand)


def test_a_starving_trainer_gets_a_replica_up_to_the_max() -> None:
    assert decide(CFG, signals(0.6, 0, 1)) == 1
    assert decide(CFG, signals(0.6, 0, 3)) == 0


def test_an_overflowing_buffer_loses_a_replica_down_to_the_min() -> None:
    assert decide(CFG, signals(0.0, 9, 2)) == -1
    assert decide(CFG, signals(0.0, 9, 1)) == 0


def test_holds_in_between_and_before_any_step() -> None:
    assert decide(CFG, signals(0.1, 4, 2)) == 0
    assert decide(CFG, signals(None, 0, 2)) == 0


def test_bounds_are_restored_first() -> None:
    assert decide(CFG, signals(None, 100, 0)) == 1
    assert decide(CFG, signals(0.9, 0, 5)) == -1


def test_wait_fraction_is_over_the_recent_steps() -> None:
    steps = [{"wait_s": 9.0, "step_s": 10.0}, {"wait_s": 1.0, "step_s": 2.0}, {"wait_s": 0.0, "step_s": 2.0},
             {"wait_s": 1.0, "step_s": 4.0}]
    assert wait_fraction(steps, window=3) == (1.0 + 0.0 + 1.0) / (2.0 + 2.0 + 4.0)
    assert wait_fraction([]) is None
