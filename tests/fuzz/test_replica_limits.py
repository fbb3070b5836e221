"""Issue 36, finding 1: one oversized request must not freeze the replica for everyone.

Before: an 8 MB body with no token (digit text, 4M token ids, 240k messages) was parsed, walked,
tokenized and rendered on the event loop before any length check: its 400 came after 3-20 s, and
another client's `/health` waited as long. Now sizes are checked on the raw body first and the
parsing runs on the request workers, so the 400 comes at once and the loop keeps answering.

A real replica process on loopback with the tiny model (4096-token context, so the derived limits
are 65536 characters, 4096 messages or token ids, 36864 JSON values). Bounds are generous (the
test machine is busy); the failures they catch took 3-20 s.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.http_client import HTTP
from tests.waiting import wait_for

from ..integration.conftest import Server, start_server, stop_server
from .test_replica_regressions import assert_error, assert_serving, post

BODY_BYTES = 8 << 20  # the replica's default max_body_bytes: the largest body it reads at all
CONTEXT = 4096  # the tiny model's max_position_embeddings
FAST_S = 2.0  # another client's call while a hostile one is being handled (it was 3-47 s)
REFUSED_S = 10.0  # the hostile request's own 400, upload of 8 MB on a busy machine included (it was 3-20 s)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("limits"))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def unlimited(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A replica whose size limits let 8 MB through: what remains is the tokenizing and rendering,
    which must run on the request workers, not on the event loop."""
    big = "100000000"
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("unlimited"), "--limits.max_prompt_chars", big,
                       "--limits.max_messages", big, "--limits.max_json_items", big)
    yield srv
    stop_server(srv)


def digit_text(size: int = BODY_BYTES) -> tuple[str, bytes]:
    """A completions prompt of ~`size` bytes of digits: one token each for the tokenizer."""
    body = {"model": "base", "max_tokens": 1, "prompt": ""}
    body["prompt"] = "7" * (size - len(json.dumps(body)) - 16)
    return "/v1/completions", json.dumps(body).encode()


def token_ids() -> tuple[str, bytes]:
    """A completions prompt of ~4M token ids."""
    head, tail = b'{"model": "base", "max_tokens": 1, "prompt": [', b"5]}"
    n = (BODY_BYTES - len(head) - len(tail) - 16) // 2
    return "/v1/completions", head + b"5," * n + tail


def many_messages(size: int = BODY_BYTES) -> tuple[str, bytes]:
    """A chat of one-letter messages, ~240k of them in 8 MB."""
    one = json.dumps({"role": "user", "content": "a"}, separators=(",", ":")).encode()
    head, tail = b'{"model": "base", "max_tokens": 1, "messages": [', b"]}"
    n = (size - len(head) - len(tail) - 16) // (len(one) + 1)
    return "/v1/chat/completions", head + b",".join([one] * n) + tail


class Watcher:
    """Another client calling /health and /v1/loads in a loop until stopped: the slowest answer seen."""

    def __init__(self, url: str) -> None:
        self.url, self.calls, self.slowest = url, 0, 0.0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        wait_for(lambda: self.calls >= 2, 60, "the watcher's first answers")  # it is calling before the request
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                for path in ("/health", "/v1/loads"):
                    t0 = time.monotonic()
                    status = client.get(self.url + path).status_code
                    if status != 200:
                        self.failed.append(f"{path}: {status}")
                    self.slowest = max(self.slowest, time.monotonic() - t0)
                    self.calls += 1


@pytest.mark.parametrize("make,needle", [
    (digit_text, "limits.max_prompt_chars"),
    (token_ids, "limits.max_json_items"),
    (many_messages, "limits.max_json_items"),
], ids=["digit-text", "token-ids", "messages"])
def test_8mb_body_is_a_fast_400_and_other_clients_are_answered_meanwhile(server: Server, make, needle: str) -> None:
    path, body = make()
    assert len(body) <= BODY_BYTES
    with Watcher(server.url) as watcher:
        t0 = time.monotonic()
        r = post(server, path, body)
        took = time.monotonic() - t0
    assert watcher.calls >= 4 and not watcher.failed, watcher.failed
    assert watcher.slowest < FAST_S, f"/health or /v1/loads took {watcher.slowest:.1f} s during the request"
    assert took < REFUSED_S, f"the 400 took {took:.1f} s"
    assert_error(r, 400, needle)
    assert_serving(server)


@pytest.mark.slow  # the work still happens (10-20 s on 2 busy cores), only elsewhere
@pytest.mark.parametrize("make,size", [(digit_text, 2 << 20), (many_messages, 3 << 20)],
                         ids=["tokenize-2mb", "render-100k-messages"])
def test_tokenizing_and_rendering_run_off_the_event_loop(unlimited: Server, make, size: int) -> None:
    """Past the limits' reach (raised here), a body still costs seconds of tokenizer or template time
    before its 400; meanwhile the event loop answers every other client."""
    path, body = make(size)
    with Watcher(unlimited.url) as watcher:
        r = post(unlimited, path, body)
    assert watcher.calls >= 4 and not watcher.failed, watcher.failed
    assert watcher.slowest < FAST_S, f"/health or /v1/loads took {watcher.slowest:.1f} s during the request"
    assert_error(r, 400, "maximum context length")
    assert_serving(unlimited)


def test_token_ids_past_the_context_are_refused_before_any_work(server: Server) -> None:
    ids = [5] * CONTEXT
    for body in ({"prompt": ids}, {"input_ids": ids}, {"prompt": [ids]}):
        r = post(server, "/v1/completions", {"model": "base", "max_tokens": 1, **body})
        assert_error(r, 400, f"has {CONTEXT} entries; this model's maximum context length is {CONTEXT}")
    r = post(server, "/v1/completions", {"model": "base", "max_tokens": 1, "prompt": ids[:-1]})
    assert r.status_code == 200, r.text  # the longest prompt that leaves room for one token


def test_chat_past_the_message_and_character_limits_names_the_limit(server: Server) -> None:
    empty = {"role": "user", "content": ""}
    r = post(server, "/v1/chat/completions", {"model": "base", "messages": [empty] * (CONTEXT + 1)})
    assert_error(r, 400, "limits.max_messages")
    parts = {"role": "user", "content": [{"type": "text", "text": ""}] * (CONTEXT + 1)}
    assert_error(post(server, "/v1/chat/completions", {"model": "base", "messages": [parts]}), 400,
                 "limits.max_messages")
    long = {"role": "user", "content": "x" * (16 * CONTEXT // 2 + 1)}
    assert_error(post(server, "/v1/chat/completions", {"model": "base", "messages": [long, long]}), 400,
                 "limits.max_prompt_chars")
    stop = {"model": "base", "messages": [empty], "stop": "y" * (16 * CONTEXT + 1)}
    assert_error(post(server, "/v1/chat/completions", stop), 400, "limits.max_prompt_chars")
    assert_error(post(server, "/v1/chat/completions", {"model": "m" * 300, "messages": [empty]}), 400, "model name")
    assert_serving(server)


def test_a_chat_within_the_limits_is_served(server: Server) -> None:
    messages = [{"role": "user", "content": "hello, world: [1, 2]"}] * 64
    r = post(server, "/v1/chat/completions", {"model": "base", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 64
    r = HTTP.get(server.url + "/health")
    assert r.status_code == 200
