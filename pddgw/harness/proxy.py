"""The TCP fault proxy between two clusters: 127.0.0.1:port -> 127.0.0.1:target.

Lifecycle of a `FaultProxy` (on the event loop that started it):

1. `await start()` binds a free port (`port`); every connection to it is
   piped to `target`, both ways, counted in `bytes`.
2. `cut()`: open connections drop (aborted), new ones are refused, until
   `heal()`.  `slow(mbps)`: every connection through the proxy shares one
   wire per direction of `mbps` megabit/s (a bandwidth collapse of the
   WAN, not of one socket), until `heal()`.
3. `await close()`: cut, stop listening, end every pipe.

`ThreadedProxy` owns a `FaultProxy` on an event loop of its own thread, for
synchronous tests whose own loop (if any) must not carry the WAN.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

TO_TARGET, FROM_TARGET = "to_target", "from_target"


class FaultProxy:
    CHUNK = 1 << 16

    def __init__(self, target: int):
        self.target = target
        self.port = 0
        self.cut_off = False
        self.bytes_per_s: float | None = None
        self.bytes = {TO_TARGET: 0, FROM_TARGET: 0}
        self._free_at = {TO_TARGET: 0.0, FROM_TARGET: 0.0}
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_w}
        pipes = [asyncio.create_task(self._pipe(reader, up_w, TO_TARGET)),
                 asyncio.create_task(self._pipe(up_r, writer, FROM_TARGET))]
        self._tasks.update(pipes)
        try:
            # A pipe cancelled by close() ends this connection quietly, not as a handler error.
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            self._tasks.difference_update(pipes)
            self._writers -= {writer, up_w}

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, way: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await r.read(self.CHUNK):
                if self.cut_off:
                    break
                rate = self.bytes_per_s
                if rate:
                    # One wire per direction: this chunk leaves once the ones before it have.
                    now = loop.time()
                    self._free_at[way] = max(now, self._free_at[way]) + len(data) / rate
                    await asyncio.sleep(self._free_at[way] - now)
                    if self.cut_off:
                        break
                self.bytes[way] += len(data)      # before the write: a reader may look the moment it lands
                w.write(data)
                await w.drain()
        except (OSError, RuntimeError):
            pass
        finally:
            if self.cut_off:
                w.transport.abort()
            else:
                w.close()

    def cut(self) -> None:
        """The WAN goes dark: open connections drop, new ones are refused."""
        self.cut_off = True
        for w in list(self._writers):
            w.transport.abort()

    def slow(self, mbps: float) -> None:
        if mbps <= 0:
            raise ValueError(f"slow: the bandwidth must be > 0 Mbit/s, not {mbps}")
        self.bytes_per_s = mbps * 1e6 / 8.0

    def heal(self) -> None:
        """The WAN is back at full speed: undoes cut and slow."""
        self.cut_off = False
        self.bytes_per_s = None

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class ThreadedProxy:
    """A `FaultProxy` on its own thread's event loop; every method is safe to call from any thread."""

    def __init__(self, target: int, timeout_s: float = 10.0):
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fault-proxy")
        self._thread.start()
        self.proxy = FaultProxy(target)
        self._call(self.proxy.start())

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)

    async def _do(self, fn: Any, *args: Any) -> None:
        fn(*args)

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def bytes(self) -> dict[str, int]:
        return dict(self.proxy.bytes)

    def cut(self) -> None:
        """The WAN goes dark: open connections drop, new ones are refused."""
        self._call(self._do(self.proxy.cut))

    def slow(self, mbps: float) -> None:
        self._call(self._do(self.proxy.slow, mbps))

    def heal(self) -> None:
        """The WAN is back: new connections go through again, at full speed."""
        self._call(self._do(self.proxy.heal))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self.proxy.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
