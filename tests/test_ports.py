"""tests/ports.py and the fault proxy's start: the storage servers' reserved ports stay theirs while they run.

The failure these guard against (a CI run): the S3 proxy's port, reserved at collection, was taken by a Ray metrics
agent's Prometheus server before the proxy started; the proxy's start failed silently, and every S3 test then got
HTTP 405 from the Prometheus page."""

from __future__ import annotations

import socket
import urllib.request

import prometheus_client
import pytest

from tests.fault_proxy import FaultProxy
from tests.ports import Reserved, _ephemeral_low, bindable


def test_a_reserved_port_is_held_for_its_server_until_released_and_outside_the_kernels_free_port_range():
    reserved = [Reserved() for _ in range(8)]
    ports = {r.port for r in reserved}
    assert len(ports) == 8
    low = _ephemeral_low()
    assert all(20000 <= p < low for p in ports), (sorted(ports), low)
    with socket.socket() as any_free:  # what Ray's metrics agent and every bind-to-0 caller get
        any_free.bind(("127.0.0.1", 0))
        assert any_free.getsockname()[1] not in ports
    first = reserved[0]
    assert not bindable(first.port, reuse=False)  # as every reservation and Ray's own port picks bind
    with pytest.raises(ConnectionRefusedError):  # held, not listening: like no server at all
        socket.create_connection(("127.0.0.1", first.port), timeout=2)
    with socket.socket() as server:  # its server (SO_REUSEADDR, as HTTPServer binds) listens beside the holder
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", first.port))
        server.listen()
        socket.create_connection(("127.0.0.1", first.port), timeout=2).close()
        assert not bindable(first.port, reuse=True) and not bindable(first.port, reuse=False)
    assert first.release() == first.port and first.release() == first.port
    assert bindable(first.port, reuse=True)
    for r in reserved:
        r.release()


def test_a_fault_proxy_whose_port_another_server_holds_fails_to_start_in_one_line():
    taken = Reserved().release()
    httpd, _ = prometheus_client.start_http_server(port=taken, addr="127.0.0.1")  # as Ray's metrics agent does
    try:
        assert b"python_gc" in urllib.request.urlopen(f"http://127.0.0.1:{taken}/", timeout=5).read()
        proxy = FaultProxy(upstream_port=Reserved().release(), port=taken)
        with pytest.raises(OSError, match=f"fault proxy: port {taken} stays busy"):
            proxy.start()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_fault_proxy_takes_its_reserved_port_and_serves_on_it():
    upstream, held = Reserved(), Reserved()
    proxy = FaultProxy(upstream_port=upstream.release(), port=held.port, held=held)
    assert not bindable(held.port, reuse=False)
    proxy.start()
    try:
        assert not proxy.refusing
        assert not bindable(held.port, reuse=True)  # now the proxy's listener holds it
        proxy.down()  # an outage: the port refuses connections and stays the proxy's
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", held.port), timeout=2)
        assert not bindable(held.port, reuse=False)
        proxy.up()
        assert not proxy.refusing and not bindable(held.port, reuse=True)
    finally:
        proxy.stop()
