"""A loopback TCP relay that adds a one-way delay to every chunk, in both directions.

Why: the capture benchmark needs the orchestrator <-> replica link to cost what a real network
costs, and the honest tool for that, `tc qdisc ... netem delay`, needs root and a network
namespace (or a veth pair), which CI machines and these sandboxes do not give us. This relay is a
stand-in: it listens on a loopback port, connects to the target, and forwards bytes both ways, each
chunk released `delay_s` after it was read, in order. Like netem it delays without limiting
throughput (chunks in flight overlap), and a new connection first waits one round trip (the TCP
handshake). Unlike netem it adds no jitter, loss or bandwidth cap, it sees chunks, not packets,
and its timers are a Python event loop's: on a busy machine a chunk leaves a millisecond or two
late (measure the relay alone when that matters).

It counts the bytes it forwards (`bytes_up`: client -> target, `bytes_down`: target -> client),
which is the traffic that would cross the network. `delay_s` may be changed while it runs; it
applies to chunks read after the change.

    relay = DelayRelay("127.0.0.1", 8000, delay_s=0.005).start()
    httpx.get(relay.url + "/health")
    relay.stop()
"""

from __future__ import annotations

import asyncio
import threading


class DelayRelay:
    """The relay, run on its own event loop in a daemon thread (owned and stopped by `stop()`)."""

    def __init__(self, target_host: str, target_port: int, delay_s: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset_counters(self) -> None:
        self.bytes_up = self.bytes_down = self.connections = 0

    def start(self) -> DelayRelay:
        """Start listening; returns once the port is bound."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="netdelay", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("netdelay relay did not start")
        return self

    def stop(self) -> None:
        """Close the listener and every open connection, then end the thread."""
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            self._loop.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """One client connection: pay the handshake round trip, then pump both directions."""
        self.connections += 1
        if self.delay_s > 0:
            await asyncio.sleep(2 * self.delay_s)
        try:
            target_r, target_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(self._pump(client_r, target_w, up=True),
                                 self._pump(target_r, client_w, up=False))
        except asyncio.CancelledError:
            pass  # stop(): end quietly (asyncio's stream callback logs a cancelled handler)
        finally:
            for w in (client_w, target_w):
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
        """Read chunks as they come and write each one `delay_s` later; order is kept by the queue.

        Reading and writing are separate tasks so that a delayed chunk never holds back the reads
        behind it: the delay is latency, not a throughput cap.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writer_task = asyncio.create_task(self._drain(queue, writer))
        try:
            while True:
                try:
                    data = await reader.read(65536)
                except (ConnectionError, OSError):
                    data = b""
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                queue.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    break
            await writer_task
        finally:
            writer_task.cancel()

    @staticmethod
    async def _drain(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                return
