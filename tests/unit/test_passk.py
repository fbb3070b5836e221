import math
import time

import pytest

from burstrl.eval.compare import compare_results, paired_bootstrap
from burstrl.eval.passk import AttemptRecord, pass_at_k, read_exclude_file, summarize

# ----- pass@k ------------------------------------------------------------------------------


def test_pass_at_k_hand_computed():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)


def test_pass_at_k_all_subsets_hit_when_n_minus_c_below_k():
    assert pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(8, 5, 4) == 1.0


def test_pass_at_k_edges():
    assert pass_at_k(6, 6, 1) == 1.0
    assert pass_at_k(6, 6, 6) == 1.0
    assert pass_at_k(6, 0, 1) == 0.0
    assert pass_at_k(6, 0, 6) == 0.0


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (8, 3), (10, 7), (200, 13)])
def test_pass_at_1_is_c_over_n(n, c):
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_matches_binomials_for_large_n():
    n, c, k = 200, 13, 50
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# ----- records and summary -----------------------------------------------------------------


def rec(task: str, i: int, resolved: bool, f2p: float = 0.0, **kw) -> AttemptRecord:
    strict = kw.pop("strict", f2p)
    return AttemptRecord(task_id=task, attempt=i, resolved=resolved, f2p=f2p, strict=strict, **kw)


def sample_records() -> list[AttemptRecord]:
    return [
        rec("a", 0, True, 1.0), rec("a", 1, False, 0.5, strict=0.0), rec("a", 2, True, 1.0),
        rec("a", 3, False, 0.0), rec("a", 4, False, infra_error="sandbox died"),
        rec("b", 0, False, 0.0, apply_ok=False), rec("b", 1, False, 0.5), rec("b", 2, False, 0.0),
        rec("b", 3, False, 0.5),
    ]


def test_record_json_round_trip_keeps_unknown_keys():
    r = rec("a", 1, True, 1.0, log_path="logs/a-1.txt", duration_s=3.5, extra={"turns": 7})
    assert AttemptRecord.from_dict(r.to_dict()) == r
    newer = {**r.to_dict(), "tokens": 123}
    assert AttemptRecord.from_dict(newer).extra == {"turns": 7, "tokens": 123}


def test_summarize_per_task_excludes_infra_failures_from_n():
    s = summarize(sample_records())
    a, b = s["tasks"]["a"], s["tasks"]["b"]
    assert (a["n"], a["c"], a["infra_failures"]) == (4, 2, 1)
    assert a["pass@1"] == pytest.approx(0.5)
    assert a["pass@2"] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert a["pass@3"] == 1.0 and a["pass@4"] == 1.0
    assert a["f2p"] == pytest.approx(2.5 / 4)
    assert a["strict"] == pytest.approx(2.0 / 4)
    assert (b["n"], b["c"], b["apply_failures"], b["infra_failures"]) == (4, 0, 1, 0)
    assert b["pass@4"] == 0.0


def test_summarize_overall_means_over_tasks():
    s = summarize(sample_records())
    o = s["overall"]
    assert o["n_tasks"] == 2 and o["attempts"] == 8 and o["resolved"] == 2
    assert o["pass@1"] == pytest.approx(0.25)
    assert o["pass@4"] == pytest.approx(0.5)
    assert o["f2p"] == pytest.approx((2.5 / 4 + 1.0 / 4) / 2)
    assert (o["apply_failures"], o["infra_failures"]) == (1, 1)
    assert s["overall_all"] == o and s["excluded"] == []


def test_summarize_with_exclude_reports_both_views():
    s = summarize(sample_records(), exclude={"b", "not-in-run"})
    assert s["excluded"] == ["b"]
    assert s["tasks"]["b"]["excluded"] is True
    assert s["overall"]["n_tasks"] == 1 and s["overall"]["pass@1"] == pytest.approx(0.5)
    assert s["overall_all"]["n_tasks"] == 2 and s["overall_all"]["pass@1"] == pytest.approx(0.25)


def test_summarize_restricts_ks_and_overall_k_to_smallest_n():
    records = sample_records() + [rec("c", 0, True, 1.0), rec("c", 1, False)]
    s = summarize(records)
    assert "pass@2" in s["overall"] and "pass@3" not in s["overall"]
    s = summarize(sample_records(), ks=[1, 3, 8])
    assert [k for k in s["tasks"]["a"] if k.startswith("pass@")] == ["pass@1", "pass@3"]


def test_summarize_task_with_only_infra_failures_is_not_scored():
    records = sample_records() + [rec("z", 0, False, infra_error="image missing")]
    s = summarize(records, ks=[1])
    assert s["tasks"]["z"]["n"] == 0
    assert s["overall"]["n_tasks"] == 2 and s["overall"]["tasks_without_attempts"] == 1
    assert s["overall"]["pass@1"] == pytest.approx(0.25)


def test_summarize_accepts_dicts(tmp_path):
    s = summarize([r.to_dict() for r in sample_records()])
    assert s["tasks"]["a"]["c"] == 2
    path = tmp_path / "flawed.txt"
    path.write_text("# flawed tasks\nb\n\n c  # comment\n")
    assert read_exclude_file(str(path)) == {"b", "c"}


# ----- paired bootstrap --------------------------------------------------------------------


def lift_scores(n: int = 60) -> tuple[dict[str, float], dict[str, float]]:
    """B is noisy around 0.3; A is B plus a lift of about 0.3 with noise."""
    b = {f"t{i}": (i * 37 % 10) / 20 for i in range(n)}
    a = {t: min(1.0, v + 0.3 + ((i * 13 % 7) - 3) / 30) for i, (t, v) in enumerate(b.items())}
    return a, b


def test_bootstrap_identical_inputs_give_zero():
    a, _ = lift_scores()
    out = paired_bootstrap(a, dict(a))
    assert out["diff"] == 0.0
    assert out["ci"][0] <= 0.0 <= out["ci"][1]
    assert out["p_value"] == 1.0 and out["n_tasks"] == len(a)


def test_bootstrap_clear_lift_has_ci_above_zero():
    a, b = lift_scores()
    out = paired_bootstrap(a, b)
    assert out["diff"] > 0.2
    assert 0 < out["ci"][0] <= out["diff"] <= out["ci"][1]
    assert out["p_value"] < 0.01
    reverse = paired_bootstrap(b, a)
    assert reverse["ci"][1] < 0 and reverse["diff"] == pytest.approx(-out["diff"])


def test_bootstrap_is_deterministic_with_seed_and_pairs_shared_tasks():
    a, b = lift_scores()
    b = {t: v + (0.5 if i % 2 else -0.5) for i, (t, v) in enumerate(b.items())}  # noisy: wide CI
    assert paired_bootstrap(a, b, seed=3) == paired_bootstrap(a, b, seed=3)
    assert paired_bootstrap(a, b, seed=3)["ci"] != paired_bootstrap(a, b, seed=4)["ci"]
    out = paired_bootstrap({**a, "only-a": 1.0}, {**b, "x": 0.0, "y": 0.0})
    assert (out["n_tasks"], out["only_a"], out["only_b"]) == (len(a), 1, 2)
    with pytest.raises(ValueError):
        paired_bootstrap({"a": 1.0}, {"b": 1.0})


def test_bootstrap_is_fast():
    a, b = lift_scores(100)
    start = time.perf_counter()
    paired_bootstrap(a, b, iters=10000)
    assert time.perf_counter() - start < 1.0


def test_compare_results_per_metric_drops_excluded_tasks():
    tasks = [f"t{i}" for i in range(30)]
    after = [rec(t, j, j < 3, 1.0 if j < 3 else 0.2) for t in tasks for j in range(4)]
    before = [rec(t, j, j < 1, 1.0 if j < 1 else 0.2) for t in tasks for j in range(4)]
    sa = summarize(after, exclude={"t0"})
    sb = summarize(before)
    out = compare_results({"summary": sa}, sb)
    assert list(out) == ["pass@1", "f2p", "strict", "pass@2", "pass@3", "pass@4"]
    assert out["pass@1"]["diff"] == pytest.approx(0.5)
    assert out["pass@1"]["n_tasks"] == 29
    assert out["pass@1"]["ci"][0] == pytest.approx(0.5)  # every task lifts the same
    assert out["pass@4"]["diff"] == pytest.approx(0.0)
    only = compare_results(sa, sb, metrics=["f2p", "pass@9"])
    assert list(only) == ["f2p"]
