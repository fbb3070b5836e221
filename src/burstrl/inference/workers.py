"""The replica's request workers: threads that parse, check, render and tokenize requests.

Why: the event loop answers every client (`/health`, `/v1/loads`, the router's scrapes, other
generation calls); whatever one request costs on it, all of them wait for (issue 36: an 8 MB body
tokenized on the loop held `/health` for 5-47 s). Run here, that work shares the interpreter lock
with the loop instead of owning it: the tokenizer releases the lock while it encodes, the chat
template and the JSON walk are Python code that yields it every switch interval (5 ms), and what
would hold it long in one C call (`json.loads` of millions of values) is bounded before it starts
(`inference.limits`).

Why threads and not processes: every worker needs the tokenizer and the session's last prompt (token
continuity); processes would each load the tokenizer and pickle every prompt both ways.

One pool per replica, made by `build_replica` and stopped by `InferenceReplica.close`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class RequestWorkers:
    """A fixed pool of threads for request parsing; `run` awaits one job without blocking the loop."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="replica-request")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread; its exception (an ApiError, say) is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Stop the threads: jobs not started are dropped, a running one (bounded by the limits) is waited for."""
        self._pool.shutdown(wait=True, cancel_futures=True)
