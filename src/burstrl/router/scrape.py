"""The router's scrapes of its replicas: one loop per replica, a total deadline per scrape, checked answers.

Why this shape (issue 36): the scrape loop is the router's only way to learn that a replica died,
filled up or came back, so no replica's answer may stop or hold it. Before, one loop scraped every
replica and waited for the whole round; httpx's timeouts are per read, so a replica dripping its
answer a byte a second held the round (and every other replica's refresh) forever; and an answer
that raised outside the caught exceptions ended the loop silently. Now:

- every replica has its own scrape task, so a slow one delays only itself;
- a scrape's two requests run side by side, each (connect to last body byte) under the scrape's total
  deadline (`burstrl.deadline.afetch`, as every outgoing call of the router), reading at most
  `max_scrape_bytes` per answer;
- answers are parsed and checked (`answers.py`) off the event loop, and a replica whose answer is
  nonsense is marked bad with the reason (out of rotation, still scraped) instead of trusted;
- the loops are supervised: an exception in one is logged, counted (`scrape_errors`) and the loop
  goes on; a task that ended anyway is started again at the next tick.

A replica given at start (`--replicas`) that was dropped (its engine died, a call found it gone)
keeps being scraped and is registered again when it answers: nothing else would bring it back. A
replica registered over HTTP is the registrar's to register again, and one deregistered by DELETE
is not scraped any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from burstrl.config import RouteConfig
from burstrl.deadline import CallFailed, afetch
from burstrl.router.answers import BadAnswer, check_answers
from burstrl.router.policies import ReplicaView
from burstrl.router.registry import Registry

log = logging.getLogger(__name__)


class ReplicaStatus(Exception):
    """A scrape answered with a status other than 200."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def scrape_deadline(cfg: RouteConfig) -> float:
    """Seconds one scrape may take in all: `scrape_timeout_s`, or max(2, 2 x scrape_s) within request_timeout_s."""
    return cfg.scrape_timeout_s or min(cfg.request_timeout_s, max(2.0, 2 * cfg.scrape_s))


class Scraper:
    """Owns the per-replica scrape tasks and their supervisor (`run`, until cancelled)."""

    def __init__(self, cfg: RouteConfig, registry: Registry, lock: asyncio.Lock,
                 http: Callable[[], httpx.AsyncClient], token: str, static: Iterable[str] = ()) -> None:
        self.cfg, self.registry, self.lock, self.http = cfg, registry, lock, http
        self.auth = {"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"}
        self.static = {url.rstrip("/") for url in static}  # `--replicas`: scraped again after a drop
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.unlisted: set[str] = set()  # replicas already warned about for not listing their sessions

    # --- one scrape --------------------------------------------------------------------------

    async def scrape(self, url: str) -> bool:
        """One scrape of `/v1/loads` and `/v1/models` (with the cluster token: replicas list their sessions
        only to it); True when the answer was applied. A failure counts toward taking the replica out of
        rotation, a 503 drops it at once, a nonsense answer marks it bad at once."""
        mark = self.registry.scrape_mark(url)
        deadline = scrape_deadline(self.cfg)
        try:
            answers = await asyncio.gather(self._get(url + "/v1/loads", deadline),
                                           self._get(url + "/v1/models", deadline), return_exceptions=True)
            loads, models = await asyncio.to_thread(check_answers, *bodies(answers))
        except ReplicaStatus as exc:
            return await self.failed(url, exc.status, str(exc))
        except CallFailed as exc:
            if exc.too_large:
                return await self.rejected(url, f"{exc} (max_scrape_bytes)")
            return await self.failed(url, None, str(exc))
        except BadAnswer as exc:
            return await self.rejected(url, str(exc))
        if "sessions" not in loads and url not in self.unlisted:  # pruning would forget its sessions
            self.unlisted.add(url)
            log.warning("replica %s lists no sessions to the router: does it have the cluster token?", url)
        return await self.apply(url, loads, models, mark)

    async def _get(self, url: str, deadline: float) -> bytes:
        """An answer's body within the scrape's deadline (`deadline.afetch`: however slowly it drips), at
        most `max_scrape_bytes` (a longer one is a CallFailed of kind too_large, not read to its end)."""
        reply = await afetch(self.http(), "GET", url, deadline=deadline, max_bytes=self.cfg.max_scrape_bytes,
                             headers=self.auth)
        if reply.status != 200:
            raise ReplicaStatus(reply.status)
        return reply.body

    async def apply(self, url: str, loads: dict[str, Any], models: dict[str, Any],
                    mark: tuple[ReplicaView, int] | None) -> bool:
        """Feed checked answers to the registry; a dropped `--replicas` replica is registered again first."""
        async with self.lock:
            view = self.registry.replicas.get(url)
            if view is None:
                if url not in self.static:
                    return False  # deregistered while the scrape ran
                view = self.registry.add(url)
                self.registry.counters.replicas_readded += 1
                log.info("replica %s (from --replicas) answered a scrape again: registered again", url)
            elif not view.healthy:
                log.info("replica %s answered a scrape again: back in rotation", url)
            self.registry.apply_scrape(url, loads, models, mark)
        return True

    async def failed(self, url: str, status: int | None, why: str) -> bool:
        async with self.lock:
            if self.registry.scrape_failed(url, status):
                gone = "dropped" if url not in self.registry.replicas else "out of rotation until it answers"
                log.warning("replica %s %s after a failed scrape (%s)", url, gone, why)
        return False

    async def rejected(self, url: str, reason: str) -> bool:
        async with self.lock:
            if self.registry.reject(url, reason):
                log.warning("replica %s out of rotation: its scrape answer is not trusted (%s)", url, reason)
        return False

    # --- the loops -----------------------------------------------------------------------------

    async def scrape_guarded(self, url: str) -> bool:
        """`scrape`, with any exception (a bug, not a replica's fault: those are handled) logged and counted."""
        try:
            return await self.scrape(url)
        except Exception:
            self.registry.counters.scrape_errors += 1
            log.exception("scrape of %s raised; the scrape loop goes on", url)
            return False

    async def run(self) -> None:
        """Until cancelled: every `scrape_s`, keep one scrape task per replica and prune finished sessions."""
        try:
            while True:
                try:
                    self.tick()
                    async with self.lock:
                        self.registry.prune()
                except Exception:
                    self.registry.counters.scrape_errors += 1
                    log.exception("the scrape supervisor's tick raised; it goes on")
                await asyncio.sleep(self.cfg.scrape_s)
        finally:
            await self.stop()

    def tick(self) -> None:
        """Start a task for every replica (registered, or from `--replicas`) without one; stop those for
        replicas gone; start again any that ended (counted: a loop is not meant to end)."""
        wanted = set(self.registry.replicas) | self.static
        for url in list(self.tasks):
            task = self.tasks[url]
            if url not in wanted:
                task.cancel()
                del self.tasks[url]
            elif task.done():
                self.registry.counters.scrape_errors += 1
                log.error("scrape loop of %s ended (%r); starting it again", url,
                          None if task.cancelled() else task.exception())
                del self.tasks[url]
        for url in wanted - set(self.tasks):
            self.tasks[url] = asyncio.create_task(self._loop(url), name=f"scrape {url}")

    async def _loop(self, url: str) -> None:
        while True:
            await self.scrape_guarded(url)
            await asyncio.sleep(self.cfg.scrape_s)

    def forget(self, url: str) -> None:
        """A replica deregistered by DELETE: not scraped again, even if it was given with `--replicas`."""
        self.static.discard(url.rstrip("/"))

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def bodies(answers: list[bytes | BaseException]) -> list[bytes]:
    """Both bodies, or the exception of a failed answer: a 503 first (the replica says it cannot
    serve: dropped at once), else the first failure."""
    errors = [a for a in answers if isinstance(a, BaseException)]
    for error in errors:
        if isinstance(error, ReplicaStatus) and error.status == 503:
            raise error
    if errors:
        raise errors[0]
    return [a for a in answers if isinstance(a, bytes)]
