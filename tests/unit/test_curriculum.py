import json
from collections import Counter

import pytest

from burstrl.config import CurriculumConfig
from burstrl.envs import Outcome, get_env
from burstrl.orchestrator.curriculum import Curriculum


def _curriculum(weights=None, seed=0, **config) -> Curriculum:
    weights = weights or {"toy": 1.0}
    return Curriculum(CurriculumConfig(**config), weights, {name: get_env(name) for name in weights}, seed)


def _group(passes: int, size: int = 4) -> list[Outcome]:
    return [Outcome(reward=float(i < passes), passed=i < passes) for i in range(size)]


def test_advances_once_the_full_window_passes_enough_then_clears_it():
    cur = _curriculum(window=4, advance_pass_rate=0.5)
    for _ in range(3):
        cur.report(cur.next_task(), _group(4))
    assert cur.difficulty("toy") == 1  # the window is not full yet
    cur.report(cur.next_task(), _group(0))
    assert cur.difficulty("toy") == 2  # 12 of 16 attempts passed
    assert cur.state()["envs"]["toy"]["pass_rate"] is None and cur.state()["envs"]["toy"]["window"] == []
    task = cur.next_task()
    assert task.difficulty == 2 and len(task.data["answer"]) == 2


def test_no_advance_below_the_threshold_and_never_past_the_maximum():
    cur = _curriculum(window=2, advance_pass_rate=0.75, task_retries=0)
    for _ in range(10):
        cur.report(cur.next_task(), _group(2))  # 50% < 75%
    assert cur.difficulty("toy") == 1
    assert cur.state()["envs"]["toy"]["pass_rate"] == 0.5

    capped = _curriculum(window=1, advance_pass_rate=0.5, max_difficulty=2)
    for _ in range(5):
        capped.report(capped.next_task(), _group(4))
    assert capped.difficulty("toy") == 2
    # 0 = the environment's own maximum; a start above it is clamped to it.
    assert _curriculum({"toy_multi": 1.0}, start_difficulty=9).difficulty("toy_multi") == 4


def test_a_retried_older_task_does_not_count_at_the_new_difficulty():
    cur = _curriculum(window=1, advance_pass_rate=0.5)
    old = cur.next_task()
    cur.report(cur.next_task(), _group(4))
    assert cur.difficulty("toy") == 2
    cur.report(old, _group(4))  # difficulty 1: not recorded in the difficulty-2 window
    assert cur.difficulty("toy") == 2 and cur.state()["envs"]["toy"]["window"] == []


def test_a_failed_task_comes_back_after_retry_after_new_groups():
    cur = _curriculum(retry_after=3, task_retries=2)
    failed = cur.next_task()
    cur.report(failed, _group(0))
    assert cur.state()["queue_length"] == 1 and cur.state()["requeued"] == 1
    fresh = [cur.next_task() for _ in range(3)]
    assert failed.id not in [t.id for t in fresh]
    assert cur.next_task() == failed
    assert cur.state()["queue_length"] == 0


def test_a_passing_group_is_not_retried_and_retry_after_zero_is_immediate():
    cur = _curriculum(retry_after=0)
    task = cur.next_task()
    cur.report(task, _group(1))
    assert cur.state()["queue_length"] == 0
    cur.report(task, _group(0))
    assert cur.next_task() == task


def test_gives_up_after_task_retries():
    cur = _curriculum(retry_after=0, task_retries=2)
    task = cur.next_task()
    for _ in range(2):
        cur.report(task, _group(0))
        assert cur.next_task() == task
    cur.report(task, _group(0))
    state = cur.state()
    assert (state["requeued"], state["gave_up"], state["queue_length"]) == (2, 1, 0)
    assert cur.next_task() != task

    never = _curriculum(task_retries=0)
    never.report(never.next_task(), _group(0))
    assert never.state()["queue_length"] == 0 and never.state()["gave_up"] == 1


def test_weights_are_respected_roughly():
    cur = _curriculum({"toy": 3.0, "toy_multi": 1.0})
    counts = Counter(cur.next_task().env for _ in range(2000))
    assert 0.71 < counts["toy"] / 2000 < 0.79
    only = _curriculum({"toy": 0.0, "toy_multi": 1.0})
    assert {only.next_task().env for _ in range(200)} == {"toy_multi"}


def test_fresh_task_ids_never_repeat_and_the_seed_decides_the_tasks():
    weights = {"toy": 1.0, "toy_multi": 1.0}
    cur = _curriculum(weights, seed=5)
    tasks = [cur.next_task() for _ in range(500)]
    assert len({t.id for t in tasks}) == 500
    same = _curriculum(weights, seed=5)
    assert [same.next_task() for _ in range(500)] == tasks
    other = _curriculum(weights, seed=6)
    assert [other.next_task().data for _ in range(50)] != [t.data for t in tasks[:50]]


def _drive(cur: Curriculum, steps: int) -> list:
    """A fixed pattern of reports: every third group fails entirely."""
    seen = []
    for i in range(steps):
        task = cur.next_task()
        seen.append(task)
        cur.report(task, _group(0 if i % 3 == 0 else 3))
    return seen


def test_state_round_trips_through_json_and_a_resumed_run_continues_identically():
    config = {"window": 3, "advance_pass_rate": 0.6, "retry_after": 2, "task_retries": 1}
    weights = {"toy": 2.0, "toy_multi": 1.0}
    first = _curriculum(weights, seed=1, **config)
    _drive(first, 38)
    saved = json.loads(json.dumps(first.state()))
    assert saved["queue_length"] > 0 and saved["requeued"] > 0
    assert any(e["difficulty"] > 1 for e in saved["envs"].values())

    resumed = _curriculum(weights, seed=1, **config)
    resumed.load_state(saved)
    assert resumed.state() == first.state()
    assert _drive(resumed, 30) == _drive(first, 30)
    assert resumed.state() == first.state()


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="weights"):
        _curriculum({"toy": 0.0})
    with pytest.raises(ValueError, match="no environment object"):
        Curriculum(CurriculumConfig(), {"toy": 1.0}, {}, 0)
    cur = _curriculum()
    task = cur.next_task()
    with pytest.raises(ValueError, match="at least one outcome"):
        cur.report(task, [])
    task.env = "elsewhere"
    with pytest.raises(ValueError, match="not in the curriculum"):
        cur.report(task, _group(1))
