"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1, in front of an object-store emulator, for the storage-fault tests.

    client (pyarrow, obstore, boto3) ──► FaultProxy 127.0.0.1:P ──► emulator 127.0.0.1:U (moto, Azurite)
                                          │ refuse_for(s): the port refuses connections for s seconds (and open
                                          │                connections drop), as a stopped endpoint does
                                          │ slowdown: a share of requests answered 503 SlowDown (S3's throttling)
                                          │ latency_s: added before each request is forwarded
                                          │ cut(n, match): the next n responses (of paths containing match) are
                                          │                cut in the middle of their body, then the connection
                                          │                closes

It relays bytes unchanged (request signatures stay valid: the Host header and every signed header pass through),
parsing only HTTP/1.1 framing: Content-Length and chunked bodies, keep-alive, ``Expect: 100-continue`` (answered
here, the header dropped, so the body arrives at once). A random generator seeded per proxy decides which
requests get a fault, and ``stats`` counts what was done, so a test can assert that faults happened.

Not a mock: the clients under test talk real HTTP to a real server through it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Any

from tests.ports import Reserved

SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>zr-fault-proxy</RequestId></Error>"
)
_MAX_HEAD = 64 << 10


class _Cut(Exception):
    """This response was cut on purpose: close both connections."""


class FaultProxy:
    """See the module docstring. Runs its own event loop in a daemon thread; every setter is thread-safe."""

    def __init__(
        self, upstream_port: int, port: int | None = None, *, seed: int = 0, held: Reserved | None = None
    ) -> None:
        self.upstream_port = upstream_port
        if port is None:
            held = Reserved()
        self.port = held.port if port is None else port
        # The port's holder, kept for the proxy's life: no other process can take the port while the proxy is
        # down (refuse_for, down), and the proxy's listener binds beside it (tests/ports.py).
        self._held = held
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.slowdown = 0.0
        self.slowdown_match: str | None = None
        self.latency_s = 0.0
        self._cuts: list[list[Any]] = []  # [remaining, match]
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "slowdowns": 0, "cuts": 0, "refused_s": 0.0, "connections": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None
        self._up_at = 0.0

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> FaultProxy:
        if self._thread is not None:
            return self
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._listen())
            except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
                failed.append(exc)
                return
            finally:
                ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="zr-fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10) or failed:  # never a proxy that is not listening (its port may be someone else's)
            self._thread = None
            raise failed[0] if failed else OSError(f"fault proxy: no listener on port {self.port} within 10 s")
        return self

    def _call(self, coro_fn, *args) -> Any:
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop).result(30)

    def down(self) -> None:
        """Refuse connections from now on (and drop the open ones) until :meth:`up`."""
        self._call(self._down)

    def up(self) -> None:
        self._call(self._listen)

    def refuse_for(self, seconds: float) -> None:
        """The endpoint refuses connections for ``seconds`` (open connections drop at once), then answers again."""
        self.down()
        self.stats["refused_s"] += seconds
        self._up_at = time.monotonic() + seconds
        self._loop.call_soon_threadsafe(lambda: self._loop.call_later(seconds, self._reopen))

    def _reopen(self) -> None:
        def reopened(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                logging.getLogger(__name__).error("%s", task.exception())  # a test then sees the port refuse

        asyncio.ensure_future(self._listen()).add_done_callback(reopened)

    @property
    def refusing(self) -> bool:
        return self._server is None

    def set_faults(self, *, slowdown: float = 0.0, latency_s: float = 0.0, slowdown_match: str | None = None) -> None:
        """``slowdown``: the share of requests (of paths containing ``slowdown_match``, when given) answered
        503 SlowDown; ``latency_s``: added before each request is forwarded."""
        with self._lock:
            self.slowdown, self.latency_s, self.slowdown_match = float(slowdown), float(latency_s), slowdown_match

    def cut(self, count: int = 1, match: str | None = None) -> None:
        """Cut the next ``count`` responses with a body (of request paths containing ``match``) in the middle."""
        with self._lock:
            self._cuts.append([count, match])

    def clear(self) -> None:
        with self._lock:
            self.slowdown, self.latency_s, self._cuts = 0.0, 0.0, []

    def stop(self) -> None:
        if self._loop is not None:
            self._call(self._down)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = self._loop = None

    # ------------------------------------------------------------------ the loop
    async def _listen(self) -> None:
        if self._server is None:
            for _ in range(50):  # a late close of our own last listener may hold it briefly
                try:
                    self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
                    return
                except OSError:
                    await asyncio.sleep(0.1)
            raise OSError(f"fault proxy: port {self.port} stays busy")

    async def _down(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._conns):
            writer.transport.abort()  # a reset, as when the endpoint's process dies
        self._conns.clear()
        if server is not None:
            await server.wait_closed()

    def _decide(self, path: str) -> tuple[bool, bool, float]:
        """(answer 503 SlowDown, cut the response, latency) for one request."""
        with self._lock:
            self.stats["requests"] += 1
            slow = (
                self.slowdown > 0
                and (self.slowdown_match is None or self.slowdown_match in path)
                and self._rng.random() < self.slowdown
            )
            cut = False
            if not slow:
                for entry in self._cuts:
                    if entry[0] > 0 and (entry[1] is None or entry[1] in path):
                        entry[0] -= 1
                        cut = True
                        break
                self._cuts = [e for e in self._cuts if e[0] > 0]
            if slow:
                self.stats["slowdowns"] += 1
            if cut:
                self.stats["cuts"] += 1
            return slow, cut, self.latency_s

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        self.stats["connections"] += 1
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                method, path, headers, raw = _parse_request(head)
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                    raw = _drop_header(raw, b"expect")
                body = await _read_body(reader, headers)
                slow, cut, latency = self._decide(path)
                if latency:
                    await asyncio.sleep(latency)
                if slow:
                    writer.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                        + str(len(SLOW_DOWN_BODY)).encode()
                        + b"\r\nRetry-After: 1\r\n\r\n"
                        + SLOW_DOWN_BODY
                    )
                    await writer.drain()
                    continue
                if upstream is None:
                    try:
                        upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                    except OSError:
                        return  # the emulator itself is down: drop the client's connection
                up_reader, up_writer = upstream
                up_writer.write(raw + body)
                await up_writer.drain()
                keep = await _relay_response(up_reader, writer, method, cut)
                if not keep:
                    up_writer.close()
                    upstream = None
                    if keep is None:  # the upstream closed: so do we (the client sees what it would have)
                        return
        except (_Cut, ConnectionError, asyncio.IncompleteReadError, OSError):
            return
        finally:
            self._conns.discard(writer)
            if upstream is not None:
                upstream[1].close()
            writer.transport.abort() if writer.transport is not None else None


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    except asyncio.LimitOverrunError:
        raise ConnectionError("request head too large") from None
    if len(head) > _MAX_HEAD:
        raise ConnectionError("request head too large")
    return head


def _headers(lines: list[bytes]) -> dict[str, str]:
    out = {}
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _parse_request(head: bytes) -> tuple[str, str, dict[str, str], bytes]:
    lines = head[:-4].split(b"\r\n")
    method, path, _ = lines[0].decode("latin-1").split(" ", 2)
    return method.upper(), path, _headers(lines[1:]), head


def _drop_header(head: bytes, name: bytes) -> bytes:
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]] + [ln for ln in lines[1:] if ln.split(b":", 1)[0].strip().lower() != name]
    return b"\r\n".join(kept) + b"\r\n\r\n"


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return await _read_chunked(reader)
    length = int(headers.get("content-length") or 0)
    return await reader.readexactly(length) if length else b""


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        out += line
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the blank line
                trailer = await reader.readuntil(b"\r\n")
                out += trailer
                if trailer == b"\r\n":
                    return bytes(out)
        out += await reader.readexactly(size + 2)


async def _relay_response(
    up: asyncio.StreamReader, client: asyncio.StreamWriter, method: str, cut: bool
) -> bool | None:
    """Relay one response. True: both connections may be reused; False: close the upstream one; None: the upstream
    closed (close the client's too). A cut response raises :class:`_Cut` after half its body."""
    while True:
        head = await _read_head(up)
        if head is None:
            return None
        lines = head[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        if status >= 200 or status == 101:
            break
        client.write(head)  # an interim 1xx answer
    headers = _headers(lines[1:])
    close = headers.get("connection", "").lower() == "close"
    if method == "HEAD" or status in (204, 304):
        client.write(head)
        await client.drain()
        return not close
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(up)
    elif "content-length" in headers:
        body = await up.readexactly(int(headers["content-length"]))
    else:  # delimited by the close
        body = await up.read()
        close = True
    if cut and len(body) > 1:
        client.write(head + body[: len(body) // 2])
        await client.drain()
        raise _Cut()
    client.write(head + body)
    await client.drain()
    return (
        None
        if close and "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "")
        else not close
    )
