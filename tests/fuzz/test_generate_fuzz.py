"""Property-based hostile bodies for `/inference/v1/generate`, through the code a replica and a router run on them.

In process, no server: what the replica runs on a body before the engine sees it (`decode_request` with
the generate limits, `parse_generate`, `to_completion`, the engine's sampling parameters) and what the
router runs to place it (`prompt_ids`, `first_call_tokens`, `prompt_blocks`). The HTTP side (status codes,
the replica serving on after each refusal) is `tests/integration/test_generate_endpoint.py`'s.

Invariants for every example: the replica's steps end in a value or an `ApiError` with a 4xx (a bare
ValueError from the sampler is `server._params`' 400), never another exception; an accepted body kept every
sampling key it was sent that changes sampling (coerced as pydantic does, never dropped); the router's helpers
never raise and give a size in [0, MAX_TOKENS_HINT].
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstrl.config.roles import RequestLimitsConfig
from burstrl.inference import generate_api as gen
from burstrl.inference import openai_api as api
from burstrl.inference.api_common import ApiError, decode_request
from burstrl.inference.limits import RequestLimits
from burstrl.router.server import MAX_TOKENS_HINT, first_call_tokens, prompt_blocks, prompt_ids

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
LIMITS = RequestLimits.derive(RequestLimitsConfig(), 256)
VOCAB = 2048

ints = st.one_of(st.integers(-3, 300), st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-50, 0.0, 1.0, -0.0]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=8))
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                      st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                      max_leaves=8)
keys = st.one_of(st.sampled_from(sorted({*gen.SERVED, *gen.NOOP_SAMPLING})), st.text(max_size=10))
SAMPLING = {"max_tokens": st.integers(-1, 300), "temperature": floats, "logprobs": ints, "top_k": ints,
            "stop_token_ids": st.lists(ints, max_size=3), "skip_special_tokens": st.booleans(), "n": ints,
            "seed": ints, "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))}
TOP = {"model": values, "token_ids": st.one_of(st.lists(ints, max_size=30), values), "cache_salt": values,
       "stream": values, "priority": values, "request_id": values, "content_parts": values, "unknown": values}
valid = st.fixed_dictionaries({"model": st.just("base"), "token_ids": st.lists(st.integers(0, 300), min_size=1,
                                                                                max_size=30),
                               "sampling_params": st.fixed_dictionaries({"max_tokens": st.integers(1, 8)})})


def fuzzed(fields: dict) -> st.SearchStrategy[dict]:
    """0-3 of `fields`, with any of their values (or any key at all, any value)."""
    some = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names}))
    return st.one_of(some, st.dictionaries(keys, values, max_size=2))


def merged(pair: tuple[dict, dict, dict]) -> dict:
    body, top, sampling = pair
    return {**body, **top, "sampling_params": {**body["sampling_params"], **sampling}}


bodies = st.one_of(st.tuples(valid, fuzzed(TOP), fuzzed(SAMPLING)).map(merged),
                   st.dictionaries(st.one_of(st.sampled_from(sorted(TOP)), st.text(max_size=6)), values, max_size=5))


def replica_steps(body: dict) -> api.CompletionRequest | None:
    """The replica's handling up to the engine; None where it answers a 4xx."""
    try:
        data = decode_request(json.dumps(body).encode(), LIMITS, gen.check_generate)
        if not isinstance(data, dict):
            return None
        completion = gen.to_completion(gen.parse_generate(data))
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.message
        return None
    try:
        api.sampling_params(completion, completion.max_tokens or 16, completion.logprobs or 0, VOCAB)
    except ValueError:
        pass  # server._params' 400
    return completion


@FUZZ
@given(bodies)
def test_generate_bodies_are_served_or_refused_with_a_4xx(body: dict) -> None:
    completion = replica_steps(body)
    if completion is None:
        return
    sent = body.get("sampling_params") or {}
    for key, value in (sent if isinstance(sent, dict) else {}).items():
        if key in gen.TEXT_ONLY:
            continue
        if key in gen.NOOP_SAMPLING:
            assert gen.NOOP_SAMPLING[key](value), key
        else:  # kept (pydantic may have coerced it: "1" -> 1), never dropped
            assert getattr(completion, key) is not None or value is None, key
    assert completion.input_ids == body["token_ids"] and completion.add_special_tokens is False


@FUZZ
@given(st.one_of(bodies, st.dictionaries(st.text(max_size=8), values, max_size=5)), st.sampled_from(["base", "x"]))
def test_router_helpers_take_any_body(body: dict, version: str) -> None:
    ids = prompt_ids(body)
    assert all(type(t) is int for t in ids)
    assert 0 <= first_call_tokens(body) <= MAX_TOKENS_HINT
    assert isinstance(prompt_blocks(body, version), tuple)


def test_token_ids_are_ints_on_the_wire_never_coerced() -> None:
    """Issue 49 (noted): pydantic's lax mode took `["5", true, 7.0]` as token ids [5, 1, 7]; a token id
    is an int as sent, on the token-in endpoint and in a completion's token prompt alike."""
    for bad in (["5", True, 7.0], [True], [7.0], ["5"], [1, False]):
        try:
            gen.parse_generate({"model": "base", "token_ids": bad})
        except ApiError as exc:
            assert exc.status == 400, bad
        else:
            raise AssertionError(f"token_ids {bad!r} were accepted")
        for field in ("prompt", "input_ids") if bad != ["5"] else ("input_ids",):  # ["5"]: a prompt of text
            try:
                api.CompletionRequest.model_validate({"model": "base", field: bad})
            except ValueError:
                continue
            raise AssertionError(f"{field} {bad!r} was accepted")
    assert gen.parse_generate({"model": "base", "token_ids": [5, 1, 7]}).token_ids == [5, 1, 7]
    assert api.CompletionRequest.model_validate({"model": "base", "prompt": [[1, 2]]}).prompt == [[1, 2]]
