import math

import pytest
import torch

from burstrl.inference.sampling import SamplingParams, process, sample

V = 32


def _logits(rows: int = 1, seed: int = 0, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2.0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_picks_argmax_and_reports_raw_log_softmax():
    logits = _logits(3)
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.1) for _ in range(3)]
    out = sample(logits, params, [None] * 3, _gen())
    raw = torch.log_softmax(logits, dim=-1)
    assert out.tokens == logits.argmax(dim=-1).tolist()
    for row, (tok, lp) in enumerate(zip(out.tokens, out.logprobs, strict=False)):
        assert lp == pytest.approx(raw[row, tok].item(), abs=1e-6)
    # top_k / top_p are ignored for greedy rows: the whole raw distribution is reported
    assert torch.allclose(process(logits, params), raw, atol=1e-6)


def test_greedy_is_deterministic_and_ignores_generators():
    logits = _logits(2, seed=3)
    params = [SamplingParams(temperature=0.0, seed=5), SamplingParams(temperature=0.0)]
    gens = [params[0].generator(torch.device("cpu")), None]
    a = sample(logits, params, gens, _gen(1))
    b = sample(logits, params, [params[0].generator(torch.device("cpu")), None], _gen(2))
    assert a.tokens == b.tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
    logits = _logits(2)
    logp = process(logits, [SamplingParams(temperature=temperature)] * 2)
    assert torch.allclose(logp, torch.log_softmax(logits / temperature, dim=-1), atol=1e-6)


def test_temperature_one_no_truncation_is_model_log_softmax():
    logits = _logits(1)
    logp = process(logits, [SamplingParams()])
    assert torch.allclose(logp, torch.log_softmax(logits, dim=-1), atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k_and_renormalises(k):
    logits = _logits(1, seed=7)
    temperature = 0.7
    logp = process(logits, [SamplingParams(temperature=temperature, top_k=k)])[0]
    finite = torch.isfinite(logp)
    assert int(finite.sum()) == k
    best = (logits[0] / temperature).topk(k).indices
    assert set(torch.nonzero(finite)[:, 0].tolist()) == set(best.tolist())
    assert torch.all(logp[~finite] == float("-inf"))
    assert logp.exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    kept = (logits[0, best] / temperature).log_softmax(-1)
    assert torch.allclose(logp[best], kept, atol=1e-6)


def test_top_k_larger_than_vocab_and_off_values_keep_everything():
    logits = _logits(3)
    params = [SamplingParams(top_k=V + 10), SamplingParams(top_k=0), SamplingParams(top_k=-1)]
    logp = process(logits, params)
    assert torch.allclose(logp, torch.log_softmax(logits, dim=-1), atol=1e-6)


def test_top_k_samples_only_kept_tokens():
    logits = _logits(1, seed=11)
    p = SamplingParams(top_k=3, seed=0)
    allowed = set(logits[0].topk(3).indices.tolist())
    g = p.generator(torch.device("cpu"))
    seen = {sample(logits, [p], [g], _gen()).tokens[0] for _ in range(300)}
    assert seen == allowed


def _nucleus_size(probs: torch.Tensor, p: float) -> int:
    """Smallest number of best tokens whose mass reaches p."""
    ordered = probs.sort(descending=True).values
    return int((ordered.cumsum(0) < p).sum()) + 1


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95])
def test_top_p_keeps_smallest_nucleus(top_p):
    logits = _logits(1, seed=2)
    probs = torch.softmax(logits[0], -1)
    logp = process(logits, [SamplingParams(top_p=top_p)])[0]
    finite = torch.isfinite(logp)
    n = _nucleus_size(probs, top_p)
    assert int(finite.sum()) == n
    best = probs.topk(n).indices
    assert set(torch.nonzero(finite)[:, 0].tolist()) == set(best.tolist())
    # the kept mass reaches top_p, and dropping the worst kept token would not
    kept = probs[best].sort(descending=True).values
    assert kept.sum() >= top_p - 1e-6
    assert kept[:-1].sum() < top_p
    assert torch.allclose(logp[best], probs[best].log() - probs[best].sum().log(), atol=1e-5)


def test_top_p_always_keeps_best_token():
    logits = torch.zeros(1, V)
    logits[0, 5] = 0.01  # best token has mass ~1/V, far below top_p
    logp = process(logits, [SamplingParams(top_p=1e-6)])[0]
    assert torch.isfinite(logp).sum() == 1
    assert logp[5].item() == pytest.approx(0.0, abs=1e-6)
    p = SamplingParams(top_p=1e-6, seed=3)
    g = p.generator(torch.device("cpu"))
    out = sample(logits, [p], [g], _gen())
    assert out.tokens == [5] and out.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_top_k_then_top_p_combined():
    logits = _logits(1, seed=4)
    k, top_p = 6, 0.6
    logp = process(logits, [SamplingParams(top_k=k, top_p=top_p)])[0]
    best = logits[0].topk(k).indices
    probs_k = torch.softmax(logits[0, best], -1)
    n = _nucleus_size(probs_k, top_p)
    assert int(torch.isfinite(logp).sum()) == n
    assert set(torch.nonzero(torch.isfinite(logp))[:, 0].tolist()) == set(best[:n].tolist())


def test_rows_have_independent_parameters():
    logits = _logits(1).repeat(6, 1)
    params = [SamplingParams(temperature=0.5, top_k=4), SamplingParams(top_k=2),
              SamplingParams(top_p=0.5), SamplingParams(temperature=2.0, top_p=0.9, top_k=10),
              SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)]
    logp = process(logits, params)
    for row, p in enumerate(params):
        alone = process(logits[row:row + 1], [p])[0]
        assert torch.equal(torch.isfinite(logp[row]), torch.isfinite(alone))
        assert torch.allclose(logp[row], alone, atol=1e-6)


def test_untruncated_rows_are_not_truncated_by_batch_mates():
    # regression: rows at top_p=1 used to lose tiny-mass tokens to float32 cumsum rounding
    # a very peaked row: its tail mass is tiny, rounding in a cumulative sum must not cut it
    peaked = torch.full((1, V), -30.0)
    peaked[0, 0] = 10.0
    logits = torch.cat([peaked, peaked, peaked, _logits(1)])
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=0.5),
              SamplingParams(top_k=3)]
    logp = process(logits, params)
    for row, p in enumerate(params[:3]):
        alone = process(logits[row:row + 1], [p])[0]
        assert torch.isfinite(logp[row]).all(), row
        assert torch.allclose(logp[row], alone, atol=1e-6), row


def test_top_k_keeps_k_even_when_kth_token_has_tiny_mass():
    logits = torch.full((1, V), -40.0)
    logits[0, 3] = logits[0, 9] = 10.0
    logp = process(logits, [SamplingParams(top_k=3)])[0]
    assert int(torch.isfinite(logp).sum()) == 3


def _draws(logits: torch.Tensor, params: list[SamplingParams], row: int, n: int) -> list[int]:
    gens = [p.generator(torch.device("cpu")) for p in params]
    default = _gen(99)
    return [sample(logits, params, gens, default).tokens[row] for _ in range(n)]


def test_seeded_row_is_reproducible():
    logits = _logits(1)
    p = SamplingParams(seed=1234)
    a = _draws(logits, [p], 0, 50)
    b = _draws(logits, [p], 0, 50)
    assert a == b
    assert len(set(a)) > 1  # it really samples
    c = _draws(logits, [SamplingParams(seed=4321)], 0, 50)
    assert a != c


def test_seeded_row_is_independent_of_batch_mates():
    base = _logits(1, seed=5)
    p = SamplingParams(seed=77, temperature=1.3, top_k=20)
    alone = _draws(base, [p], 0, 100)
    others = _logits(3, seed=6)
    batch = torch.cat([others[:2], base, others[2:]])
    params = [SamplingParams(), SamplingParams(seed=1, top_p=0.9), p, SamplingParams(temperature=0.0)]
    together = _draws(batch, params, 2, 100)
    assert alone == together
    params2 = [SamplingParams(seed=1234), p]
    assert _draws(torch.cat([others[:1], base]), params2, 1, 100) == alone


def test_unseeded_rows_use_the_default_generator():
    logits = _logits(2)
    params = [SamplingParams(), SamplingParams()]

    def run(seed):
        g = _gen(seed)
        return [sample(logits, params, [None, None], g).tokens for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.5, top_k=5),
    SamplingParams(top_p=0.7),
])
def test_empirical_frequency_matches_logprob(params):
    n = 20000
    logits = _logits(1, seed=8, vocab=8)
    logp = process(logits, [params])[0]
    # n independent rows in one call: each row draws once from the shared generator
    batch = logits.repeat(n, 1)
    out = sample(batch, [params] * n, [None] * n, _gen(0))
    counts = torch.bincount(torch.tensor(out.tokens), minlength=8).double() / n
    probs = logp.exp().double()
    # 5 sigma binomial bound per token
    tol = 5 * torch.sqrt(probs * (1 - probs) / n) + 1e-3
    assert torch.all((counts - probs).abs() <= tol), (counts, probs)
    assert torch.all(counts[probs == 0] == 0)
    # every reported logprob is that of the distribution it was drawn from
    assert all(lp == pytest.approx(logp[t].item(), abs=1e-6) for t, lp in zip(out.tokens[:50], out.logprobs[:50], strict=False))


def test_empirical_frequency_seeded_row():
    n = 4000
    logits = _logits(1, seed=9, vocab=6)
    p = SamplingParams(temperature=0.8, seed=2)
    g = p.generator(torch.device("cpu"))
    tokens = [sample(logits, [p], [g], _gen()).tokens[0] for _ in range(n)]
    probs = process(logits, [p])[0].exp().double()
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double() / n
    tol = 5 * torch.sqrt(probs * (1 - probs) / n) + 1e-3
    assert torch.all((counts - probs).abs() <= tol), (counts, probs)


def test_top_logprobs_returns_k_best():
    logits = _logits(2, seed=10)
    params = [SamplingParams(top_logprobs=3), SamplingParams(top_logprobs=5, temperature=0.0)]
    out = sample(logits, params, [None, None], _gen())
    assert out.top is not None and len(out.top) == 2
    for row, p in enumerate(params):
        logp = process(logits[row:row + 1], [p])[0]
        want = logp.topk(p.top_logprobs)
        got = out.top[row]
        assert len(got) == p.top_logprobs
        assert [t for t, _ in got] == want.indices.tolist()
        assert [v for _, v in got] == pytest.approx(want.values.tolist(), abs=1e-6)
        values = [v for _, v in got]
        assert values == sorted(values, reverse=True)


def test_top_logprobs_zero_gives_none_and_mixed_rows():
    logits = _logits(2)
    out = sample(logits, [SamplingParams(), SamplingParams()], [None, None], _gen())
    assert out.top is None
    out = sample(logits, [SamplingParams(), SamplingParams(top_logprobs=2)], [None, None], _gen())
    assert out.top is not None and out.top[0] == [] and len(out.top[1]) == 2


def test_top_logprobs_with_top_k_reports_masked_as_minus_inf():
    logits = _logits(1)
    out = sample(logits, [SamplingParams(top_k=2, top_logprobs=4)], [None], _gen())
    values = [v for _, v in out.top[0]]
    assert all(math.isfinite(v) for v in values[:2])
    assert all(v == float("-inf") for v in values[2:])


@pytest.mark.parametrize("kwargs, word", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 101.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 9}, "stop"),
])
def test_validate_rejects_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_edges():
    for p in [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=100.0),
              SamplingParams(top_p=1.0, top_k=-1, top_logprobs=20, stop=["a"] * 8, max_tokens=1)]:
        p.validate()


def test_a_nan_row_fails_alone_and_the_others_are_sampled():
    logits = _logits(3)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    out = sample(logits, params, [None] * 3, _gen())
    assert set(out.errors) == {1} and "not finite" in out.errors[1]
    assert out.tokens[1] == -1 and 0 <= out.tokens[0] < V and out.tokens[2] == int(logits[2].argmax())


def test_raw_logprobs_are_shown_and_processed_ones_kept():
    logits = _logits(1)
    params = [SamplingParams(temperature=0.5, top_k=3, top_logprobs=2)]
    out = sample(logits, params, [None], _gen(), raw=True)
    raw = torch.log_softmax(logits, dim=-1)[0]
    tok = out.tokens[0]
    assert out.shown[0] == pytest.approx(raw[tok].item(), abs=1e-6)
    assert out.logprobs[0] == pytest.approx(process(logits, params)[0, tok].item(), abs=1e-6)
    assert out.logprobs[0] > out.shown[0]  # sharper than the raw distribution
    assert out.shown_top[0][0][1] == pytest.approx(raw.max().item(), abs=1e-6)


@pytest.mark.parametrize("kw,needle", [
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("inf")}, "top_p"), ({"repetition_penalty": 1e-50}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"), ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"min_tokens": 17}, "min_tokens"), ({"min_p": 1.5}, "min_p"),
])
def test_out_of_range_values_are_refused_by_name(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw).validate(vocab_size=V)


def test_tiny_temperature_is_greedy_and_huge_top_k_is_off():
    p = SamplingParams(temperature=1e-50, top_k=2**63)
    p.validate(vocab_size=V)
    assert p.temperature == 0.0 and p.top_k == 0
    q = SamplingParams(logit_bias={V: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        q.validate(vocab_size=V)


def test_penalties_and_bias_shift_the_processed_logits():
    from burstrl.inference.sampling import History

    logits = torch.zeros(1, V)
    hist = [History(prompt=[1], output=[2, 2, 3])]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={4: 2.0}, temperature=1.0)
    logp = process(logits, [p], hist)[0]
    base = logp[10]
    assert logp[2] - base == pytest.approx(-(0.5 + 2 * 0.25), abs=1e-5)
    assert logp[3] - base == pytest.approx(-(0.5 + 0.25), abs=1e-5)
    assert logp[4] - base == pytest.approx(2.0, abs=1e-5)
    assert logp[1] == pytest.approx(base.item(), abs=1e-6)  # presence/frequency look at the output only
    rep = SamplingParams(repetition_penalty=2.0)
    logits = torch.full((1, V), 1.0)
    logits[0, 5] = -1.0
    logp = process(logits, [rep], [History(prompt=[5], output=[6])])[0]
    assert logp[6] - logp[7] == pytest.approx(0.5 - 1.0, abs=1e-5)  # positive logit halved
    assert logp[5] - logp[7] == pytest.approx(-2.0 - 1.0, abs=1e-5)  # negative logit doubled


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    from burstrl.inference.sampling import History

    logits = torch.zeros(2, V)
    p = SamplingParams(min_tokens=2, stop_token_ids=[9])
    early = process(logits, [p, p], [History([], [1]), History([], [1, 2])], eos_ids=[0])
    assert early[0, 0] == float("-inf") and early[0, 9] == float("-inf")
    assert torch.isfinite(early[1]).all()


def test_min_p_keeps_tokens_at_least_that_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    logp = process(logits, [SamplingParams(min_p=0.2)])[0]
    assert torch.isfinite(logp[:3]).all() and not torch.isfinite(logp[3:]).any()
