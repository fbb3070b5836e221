"""The router's scrape loops are supervised (issue 36): an exception in one is counted and logged, and
scraping goes on; a loop that ended is started again. In-process (a `Scraper` on an asyncio loop)
against a stand-in replica on loopback; the fault is a registry that raises while applying answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from burstrl.config import RouteConfig
from burstrl.router.registry import Registry
from burstrl.router.scrape import Scraper, scrape_deadline
from burstrl.router.standin import StandInReplica


class FaultyRegistry(Registry):
    """Raises from `apply_scrape` the first `faults` times: a bug the scrape itself does not expect."""

    def __init__(self, faults: int) -> None:
        super().__init__(seed=0)
        self.faults = faults

    def apply_scrape(self, *args, **kwargs) -> None:
        if self.faults > 0:
            self.faults -= 1
            raise RuntimeError("a bug while applying a scrape")
        super().apply_scrape(*args, **kwargs)


async def until(ok: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def run_scraper(registry: Registry, ok: Callable[[Scraper], bool], static: tuple[str, ...] = ()) -> Scraper:
    """Run `Scraper.run` until `ok(scraper)`, then cancel it and check its tasks are gone."""
    async def main() -> Scraper:
        async with httpx.AsyncClient() as client:
            scraper = Scraper(RouteConfig(scrape_s=0.05), registry, asyncio.Lock(), lambda: client, "t", static)
            supervisor = asyncio.create_task(scraper.run())
            await until(lambda: ok(scraper))
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
            assert not scraper.tasks
            return scraper

    return asyncio.run(main())


def test_regression_an_exception_in_a_scrape_is_counted_and_scraping_goes_on() -> None:
    standin = StandInReplica()
    try:
        registry = FaultyRegistry(faults=3)
        registry.add(standin.url)
        run_scraper(registry, lambda _: registry.replicas[standin.url].versions == {"base"})  # was: the loop ended
        assert registry.counters.scrape_errors == 3 and registry.faults == 0
    finally:
        standin.close()


def test_a_loop_that_ended_is_started_again_and_counted() -> None:
    standin = StandInReplica()
    try:
        registry = Registry(seed=0)
        registry.add(standin.url)

        def ended_once(scraper: Scraper) -> bool:
            task = scraper.tasks.get(standin.url)
            if task is not None and not task.done() and registry.counters.scrape_errors == 0:
                task.cancel()  # a loop that ends (it never should): the next tick starts another
            return registry.counters.scrape_errors == 1 and standin.counts["loads"] >= 3

        run_scraper(registry, ended_once)
    finally:
        standin.close()


def test_a_dropped_command_line_replica_is_scraped_and_registered_again() -> None:
    standin, other = StandInReplica(), StandInReplica()
    try:
        registry = Registry(seed=0)
        registry.add(other.url)  # registered over HTTP, not from the command line: left alone once dropped
        registry.mark_dead(other.url)
        run_scraper(registry, lambda _: standin.url in registry.replicas, static=(standin.url,))
        assert registry.counters.replicas_readded == 1 and other.url not in registry.replicas
        assert other.counts["loads"] == 0
    finally:
        standin.close()
        other.close()


def test_the_scrape_deadline_defaults_to_twice_the_interval_at_least_2_s() -> None:
    assert scrape_deadline(RouteConfig(scrape_s=0.2)) == 2.0
    assert scrape_deadline(RouteConfig(scrape_s=5)) == 10.0
    assert scrape_deadline(RouteConfig(scrape_s=5, request_timeout_s=3)) == 3.0
    assert scrape_deadline(RouteConfig(scrape_timeout_s=0.5)) == 0.5
