"""Property-based hostile input for the OpenEnv adapter: server frames and model replies, in process.

Invariants: a frame from the server becomes a checked `StepResult` (a dict observation, a finite float
reward, a bool done) or raises `InfraError` / `ActionRejected`, never anything else (a bug would stop
the orchestrator); a model reply becomes a JSON-serializable action dict or raises `ReplyError`; the
user turn built from any observation is text an HTTP body can carry.
"""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstrl.envs.base import InfraError
from burstrl.envs.ecosystem.openenv_env import ReplyError, parse_reply, user_turn
from burstrl.envs.ecosystem.openenv_ws import ActionRejected, parse_frame

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from([10**400, -(10**400)]), st.floats(),
                    st.text(max_size=8))
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                      st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                      max_leaves=10)
frames = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["observation", "error", "state", 3]),
                           "data": st.one_of(values, st.fixed_dictionaries(
                               {"observation": values, "reward": scalars, "done": scalars},
                               optional={"code": st.sampled_from(["VALIDATION_ERROR", "EXECUTION_ERROR",
                                                                  "CAPACITY_REACHED", "X"]),
                                         "message": values, "errors": values}))}),
    values)
schemas = st.one_of(st.just({"required": ["answer"]}), st.just({"required": ["a", "b"]}),
                    st.dictionaries(st.sampled_from(["required", "type"]), values, max_size=2))


@FUZZ
@given(frame=frames, during=st.sampled_from(["reset", "step"]))
def test_a_frame_is_checked_or_refused(frame: object, during: str) -> None:
    raw = json.dumps(frame)
    try:
        result = parse_frame(raw, during)
    except (InfraError, ActionRejected):
        return
    assert isinstance(result.observation, dict) and isinstance(result.done, bool)
    assert isinstance(result.reward, float) and math.isfinite(result.reward)


@FUZZ
@given(raw=st.one_of(st.text(max_size=40), st.binary(max_size=20)), during=st.sampled_from(["reset", "step"]))
def test_any_text_frame_is_checked_or_refused(raw: str | bytes, during: str) -> None:
    try:
        parse_frame(raw, during)
    except (InfraError, ActionRejected):
        pass


@FUZZ
@given(reply=st.one_of(st.text(max_size=40), values.map(json.dumps),
                       values.map(lambda v: f"```json\n{json.dumps(v)}\n```")), schema=schemas)
def test_a_reply_is_an_action_or_a_reply_error(reply: str, schema: dict) -> None:
    try:
        action = parse_reply(reply, schema)
    except ReplyError:
        return
    assert isinstance(action, dict)
    json.dumps(action, allow_nan=False)


@FUZZ
@given(observation=st.dictionaries(st.text(max_size=6), values, max_size=4), schema=schemas)
def test_a_user_turn_is_utf8_text(observation: dict, schema: dict) -> None:
    text = user_turn(observation, schema)
    text.encode("utf-8")
    assert json.loads(text) is not None
