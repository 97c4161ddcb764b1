"""Loopback ports for the tests' servers (storage emulators, the fault proxy, `ray start`, torch's rendezvous):
reserved when a test module is collected or a test needs them, held until the server is done with them, and out of
the range where Ray and everything else pick ports.

Why: the endpoints must be in the environment before any test starts Ray (its workers inherit them), but the servers
start minutes later, the S3 fault tests take the proxy down for seconds at a time, and ``ray start`` binds its ports
only once its processes are up. A port found by binding port 0 comes from the kernel's ephemeral range, where every
Ray node picks its own ports too: in a CI run a Ray metrics agent took the S3 proxy's port in that gap, and every S3
test then got HTTP 405 from a Prometheus page.

So a :class:`Reserved` port lies between Ray's worker ports (10002-19999 by default) and the kernel's ephemeral range
(from /proc/sys/net/ipv4/ip_local_port_range), where nothing that asks the kernel for a free port can land, and a
bound socket holds it (not listening: a connection is refused, as with no server) until :meth:`Reserved.release`.

How the holder lets its own server in: it binds first *without* SO_REUSEADDR, so the bind fails on any port another
socket has (another pytest-xdist worker's reservation included), and only then turns SO_REUSEADDR on. From then on
a bind without SO_REUSEADDR fails there (every other reservation, Ray's own port picks), while a server that binds
with SO_REUSEADDR (werkzeug/moto, asyncio's servers, Go's fake-gcs-server, libuv's Azurite and TCPStore, gRPC and
aiohttp in a Ray head) binds and listens beside the holder. The port is never free between the reservation and the
server, nor while the server is down (a restart, an outage of the fault proxy).

Limit: a server that binds without SO_REUSEADDR cannot take a held port; release it first (the gap comes back).
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator
from pathlib import Path

ABOVE_RAY_WORKER_PORTS = 20000
WELL_KNOWN = {29400, 29500}  # torchrun's rendezvous and torch.distributed's MASTER_PORT defaults


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class Reserved:
    """One loopback port, held by a bound socket until :meth:`release` (idempotent); its server binds it with
    SO_REUSEADDR meanwhile (see the module docstring)."""

    def __init__(self) -> None:
        self._holder: socket.socket | None = None
        low, high = ABOVE_RAY_WORKER_PORTS, _ephemeral_low()
        candidates = random.sample(range(low, high), min(200, high - low)) if high - low >= 1000 else []
        candidates = [p for p in candidates if p not in WELL_KNOWN]
        for port in candidates + [0]:  # 0: an unusual port range; the kernel's choice is better than none
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))  # exclusive: fails where anyone holds the port
            except OSError:
                sock.close()
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # now its server may bind beside it
            self._holder, self.port = sock, sock.getsockname()[1]
            return
        raise OSError("no free loopback port to reserve")

    def release(self) -> int:
        """Let go of the port and return it."""
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        return self.port


@contextlib.contextmanager
def held_ports(n: int = 1) -> Iterator[list[int]]:
    """``n`` distinct reserved ports, held until the block ends: for servers started inside it (``ray start``, a
    TCPStore), or for an address where nothing may answer."""
    reserved = [Reserved() for _ in range(n)]
    try:
        yield [r.port for r in reserved]
    finally:
        for r in reserved:
            r.release()


def bindable(port: int, *, reuse: bool = True) -> bool:
    """Whether a server could bind ``port`` on 127.0.0.1 now (``reuse``: with SO_REUSEADDR, as werkzeug's and
    Python's HTTP servers bind)."""
    with socket.socket() as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
