"""The arithmetic game (`game`) as an OpenEnv server, written with openenv's own classes.

Serve it from the repository root (`pip install 'burstrl[openenv]'` first):

    python -m examples.openenv_envs.arith.server --port 8000      # or --port 0: any free port
    uvicorn examples.openenv_envs.arith.server:app --port 8000

With --port, it prints one JSON line `{"event": "ready", "url": ..., "pid": ...}` once it listens
(how burstrl's own servers say where they are; the tests read it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any
from uuid import uuid4

from fastapi import FastAPI
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from openenv.core.rubrics import Rubric
from pydantic import Field

from examples.openenv_envs.arith import game


class ArithAction(Action):
    answer: int = Field(..., description="The sum, as one integer.")


class ArithObservation(Observation):
    question: str = ""
    hint: str = Field("", description="After a wrong answer: too low or too high.")
    tries_left: int = 0


class ArithState(State):
    a: int = 0
    b: int = 0


class ExactAnswer(Rubric):
    """1.0 for the right sum, else 0.0."""

    def __init__(self, env: ArithEnvironment) -> None:
        super().__init__()
        self._env = env

    def forward(self, action: ArithAction, observation: ArithObservation) -> float:
        state = self._env.state
        return float(action.answer == state.a + state.b)


class ArithEnvironment(Environment[ArithAction, ArithObservation, ArithState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session, nothing shared

    def __init__(self) -> None:
        super().__init__()
        self.rubric = ExactAnswer(self)
        self._state = ArithState(episode_id=str(uuid4()))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ArithObservation:
        self._reset_rubric()
        a, b = game.problem(seed)
        self._state = ArithState(episode_id=episode_id or str(uuid4()), a=a, b=b)
        return ArithObservation(question=game.question(a, b), tries_left=game.MAX_TRIES)

    def step(self, action: ArithAction, timeout_s: float | None = None, **kwargs: Any) -> ArithObservation:
        s = self._state
        s.step_count += 1
        obs = ArithObservation(question=game.question(s.a, s.b), hint=game.hint(action.answer, s.a, s.b),
                               tries_left=game.MAX_TRIES - s.step_count)
        obs.reward = self._apply_rubric(action, obs)
        obs.done = obs.reward == 1.0 or s.step_count >= game.MAX_TRIES
        return obs

    @property
    def state(self) -> ArithState:
        return self._state


def make_app(max_sessions: int = 64) -> FastAPI:
    """The FastAPI app: /ws episodes, /health, /schema (and openenv's other routes)."""
    return create_app(ArithEnvironment, ArithAction, ArithObservation, env_name="arith",
                      max_concurrent_envs=max_sessions, state_cls=ArithState)


app = make_app()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-sessions", type=int, default=64)
    args = p.parse_args(argv)
    sock = socket.create_server((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(json.dumps({"event": "ready", "url": f"http://{host}:{port}", "pid": os.getpid()}), flush=True)
    config = uvicorn.Config(make_app(args.max_sessions), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
