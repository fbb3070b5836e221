"""Sandbox placement: the usage-peak predictor and each policy's choices on hand-made nodes."""

import random

import pytest

from burstrl.sandbox.placement import (
    GIB,
    ImageAffinityPolicy,
    Layer,
    NodeState,
    OursPolicy,
    PlacedSandbox,
    Prior,
    ReferencePolicy,
    Resources,
    SandboxRequest,
    Usage,
    make_policy,
    predict_peak,
)

ALLOC = Resources(15.0, 62 * GIB, 32768)
LAYERS = (Layer("sha256:os", 80_000_000), Layer("sha256:repo", 2_000_000_000), Layer("sha256:task", 300_000_000))


def request(cpu: float = 2.0, name: str = "r", prior: Prior = Prior()) -> SandboxRequest:
    return SandboxRequest(name, LAYERS, Resources(cpu, cpu * 2 * GIB, 512), prior)


def sandbox(policy, cpu: float = 2.0, cpu_use: Usage = Usage(0.4, 0.1, 0.8), mem_use: Usage | None = None,
            name: str = "s") -> PlacedSandbox:
    req = request(cpu, name)
    mem_use = mem_use or Usage(0.1 * GIB, (0.05 * GIB) ** 2, 0.2 * GIB)
    return PlacedSandbox(name, policy.requests(req), req.limits, cpu_use, mem_use)


def node(name: str, sandboxes=(), layers=None) -> NodeState:
    return NodeState(name, ALLOC, list(sandboxes), dict(layers or {}))


def test_predictor_is_the_max_of_the_normal_bound_and_the_sum_of_percentiles():
    many = [Usage(1.0, 0.25, 1.2)] * 16  # many calm sandboxes: the normal bound rules
    assert predict_peak(many, sigmas=3) == pytest.approx(16 + 3 * 2.0)
    few = [Usage(0.5, 0.01, 4.0)] * 2  # a few heavy-tailed ones: their own percentiles rule
    assert predict_peak(few, sigmas=3) == pytest.approx(8.0)
    assert predict_peak(few, sigmas=3, percentiles=False) == pytest.approx(1.0 + 3 * 0.02 ** 0.5)
    assert predict_peak([], sigmas=3) == 0.0


def test_usage_of_samples():
    u = Usage.of([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], percentile=90)
    assert u.mean == pytest.approx(4.5)
    assert u.var == pytest.approx(8.25)
    assert u.high == 9.0
    assert Usage.of([]) == Usage()
    assert Usage(1, 2, 3).scaled(2) == Usage(2, 8, 6)


def test_reference_requests_fixed_ratios_and_packs_the_fullest_node():
    policy = ReferencePolicy()
    req = request(4.0)
    assert policy.requests(req) == Resources(1.0, 0.4 * 8 * GIB, 512)
    empty, busy = node("a"), node("b", [sandbox(policy, name=f"s{i}") for i in range(10)])
    assert policy.choose([empty, busy], req) is busy
    full = node("c", [sandbox(policy, name=f"s{i}") for i in range(29)])  # 29 x 0.5 vCPU = 14.5 of 15
    assert policy.choose([full], req) is None
    assert policy.choose([full], request(2.0)) is full  # 0.5 more fits exactly


def test_reference_ignores_cached_layers_and_affinity_prefers_them():
    ref, aff = ReferencePolicy(), ImageAffinityPolicy()
    sandboxes = [sandbox(ref, name=f"s{i}") for i in range(4)]
    holder = node("holder", layers={layer.digest: layer.size for layer in LAYERS})
    fuller = node("fuller", sandboxes)
    assert ref.choose([holder, fuller], request()) is fuller
    assert aff.choose([holder, fuller], request()) is holder
    partial = node("partial", sandboxes, {"sha256:os": LAYERS[0].size})
    assert aff.choose([partial, holder], request()) is holder  # more of the image's bytes beat a few


def test_ours_prefers_the_node_holding_the_layers():
    ours = OursPolicy()
    holder = node("holder", layers={layer.digest: layer.size for layer in LAYERS[1:]})
    other = node("other", [sandbox(ours, name="x")])
    assert ours.choose([other, holder], request()) is holder


def test_ours_packs_more_than_reference_on_measured_low_usage():
    """Density from measured usage: idle-ish sandboxes leave room the fixed 25% requests would not."""
    ref, ours = ReferencePolicy(), OursPolicy()
    calm = Usage(0.3, 0.04, 0.6)

    def fill(policy) -> int:
        n = node("n")
        while policy.choose([n], request(2.0, name=f"s{len(n.sandboxes)}")) is not None:
            n.sandboxes.append(sandbox(policy, 2.0, calm, name=f"s{len(n.sandboxes)}"))
            assert len(n.sandboxes) < 200
        return len(n.sandboxes)

    assert fill(ref) == 30  # 15 vCPU / 0.5
    assert fill(ours) > fill(ref)


def test_ours_refuses_when_the_predicted_memory_peak_passes_allocatable():
    ours = OursPolicy()
    heavy = Usage(8 * GIB, (4 * GIB) ** 2, 21 * GIB)  # each may reach 21 GiB
    n = node("n", [sandbox(ours, 2.0, mem_use=heavy, name="a"), sandbox(ours, 2.0, mem_use=heavy, name="b")])
    assert ours.choose([n], request()) is not None  # 42 GiB + the prior's share: fits in 62
    n.sandboxes.append(sandbox(ours, 2.0, mem_use=heavy, name="c"))
    assert ours.choose([n], request()) is None  # 63 GiB: past allocatable


def test_admission_never_binds_past_allocatable():
    """Random nodes and requests: whatever node a policy picks, its requests (and for ours the predicted
    peaks) with the new sandbox stay within allocatable."""
    rng = random.Random(0)
    for name in ("reference", "image_affinity", "ours"):
        policy = make_policy(name)
        for trial in range(60):
            nodes = []
            for i in range(4):
                sandboxes = []
                for j in range(rng.randint(0, 40)):
                    cpu = rng.choice([1, 2, 4, 8])
                    mean = rng.uniform(0, 0.5) * cpu
                    use = Usage(mean, (rng.uniform(0, 0.4) * cpu) ** 2, min(cpu, 2 * mean))
                    mem = Usage(rng.uniform(0, 0.2) * cpu * 2 * GIB, (0.1 * cpu * GIB) ** 2, 0.5 * cpu * GIB)
                    sandboxes.append(sandbox(policy, cpu, use, mem, name=f"{i}-{j}"))
                nodes.append(node(str(i), sandboxes))
            req = request(rng.choice([1, 2, 4, 8]), name=f"t{trial}")
            chosen = policy.choose(nodes, req)
            if chosen is None:
                continue
            assert (chosen.requested() + policy.requests(req)).fits_in(chosen.allocatable)
            if name == "ours":
                cpu, mem = policy.predicted(chosen, req)
                assert cpu <= chosen.allocatable.cpu and mem <= chosen.allocatable.mem


def test_ties_go_to_the_earlier_node_and_bad_names_fail_clearly():
    policy = ReferencePolicy()
    a, b = node("a"), node("b")
    assert policy.choose([a, b], request()) is a
    assert policy.choose([b, a], request()) is b
    with pytest.raises(ValueError, match="unknown placement policy"):
        make_policy("spread")
    with pytest.raises(ValueError, match="ours"):
        make_policy("ours", sigmas=2)
    assert make_policy("ours", cpu_sigmas=1.0).cpu_sigmas == 1.0
