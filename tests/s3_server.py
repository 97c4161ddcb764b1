"""A real S3 API server on 127.0.0.1 for the object-storage tests: moto's server mode (``ThreadedMotoServer``).

Not a mock of any client: pyarrow, Zephon (obstore) and boto3 all talk HTTP to it. The endpoint and credentials
follow the AWS SDK conventions (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``), and :func:`configure_environment` puts them in this process's environment when a test module is
*collected*, before any test starts Ray, so that every Ray worker the session starts inherits them (as a Ray job's
workers get them through its runtime_env). The server itself starts on first use, on the port reserved then
(tests/ports.py: held for the whole session, where Ray cannot take it).

The endpoint the clients under test use is a :class:`tests.fault_proxy.FaultProxy` in front of moto (``faults``):
it passes everything through until a test asks it for an outage, 503 SlowDown answers, latency or cut responses.
The tests' own set-up and checks (``client()``, ``keys``) talk to moto directly, past the faults.

Import it as ``tests.s3_server`` (the ``s3`` fixture of tests/conftest.py does): the server and its reserved ports
are this module's state, and a second copy of the module (``import s3_server``, tests/ being on sys.path too) would
reserve nothing and start a second proxy on the first one's port.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import urllib.request
import uuid
from pathlib import Path

from tests.ports import Reserved, bindable

if __name__ != "tests.s3_server":
    raise ImportError(f"import tests.s3_server, not {__name__}: one module, one server per process")

_RECORDING = os.path.join(tempfile.gettempdir(), f"zr-moto-recording-{os.getpid()}.jsonl")
os.environ.setdefault("MOTO_RECORDER_FILEPATH", _RECORDING)  # read by moto when it is imported

ACCESS_KEY = "zr-test-key"
SECRET_KEY = "zr-test-secret"
REGION = "us-east-1"
PORT_ENV = "ZR_TEST_S3_PORT"
PROXY_PORT_ENV = "ZR_TEST_S3_PROXY_PORT"


class S3Server:
    """One moto server on a fixed loopback port: ``start``/``stop``/``restart`` keep its buckets (moto's state
    lives in this process), which is how the tests stop the endpoint mid-run and bring it back."""

    def __init__(
        self, port: int, proxy_port: int, *, held: Reserved | None = None, proxy_held: Reserved | None = None
    ) -> None:
        from tests.fault_proxy import FaultProxy

        self.port = port
        self.faults = FaultProxy(port, proxy_port, held=proxy_held)
        self._held = held  # moto's port holder, kept while this process runs (tests/ports.py)
        self.endpoint = self.faults.endpoint
        self._server = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def direct_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        with self._lock:
            if self._server is None:
                from moto.server import ThreadedMotoServer

                if not bindable(self.port):
                    # Never held here (a process that inherited the port) and taken: moto's start would wait
                    # forever (its server thread exits without signalling). Only the fault proxy and this process's
                    # own client use this port (Ray's workers reach the proxy), so moto moves.
                    self._held = Reserved()
                    self.port = self.faults.upstream_port = self._held.port
                    os.environ[PORT_ENV] = str(self.port)

                logging.getLogger("werkzeug").setLevel(logging.ERROR)
                self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
                self._server.start()
            self.faults.start()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.direct_endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def new_bucket(self, prefix: str = "zr") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> None:
        client = self.client()
        for path in sorted(Path(local).rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix.strip('/')}/{path.relative_to(local)}")

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        out = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj["Size"]
        return out

    def _post(self, path: str, data: bytes = b"") -> bytes:
        req = urllib.request.Request(
            f"{self.direct_endpoint}{path}", data=data, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read()

    def require_auth(self, on: bool) -> None:
        """Turn moto's IAM request authentication on (every request then needs an access key moto issued: our
        test key is refused as 'InvalidAccessKeyId') or off (any key works)."""
        self._post("/moto-api/reset-auth", b"0" if on else b"inf")

    def recording(self) -> _Recording:
        return _Recording(self)


class _Recording:
    """The HTTP requests the server received while the block ran (moto's own recorder)."""

    def __init__(self, server: S3Server) -> None:
        self.server = server
        self.requests: list[dict] = []

    def __enter__(self) -> _Recording:
        self.server._post("/moto-api/recorder/reset-recording")
        self.server._post("/moto-api/recorder/start-recording")
        return self

    def __exit__(self, *exc) -> None:
        self.server._post("/moto-api/recorder/stop-recording")
        path = os.environ["MOTO_RECORDER_FILEPATH"]
        if os.path.exists(path):
            with open(path) as fh:
                self.requests = [json.loads(line) for line in fh if line.strip()]

    def gets(self) -> list[str]:
        """URLs of GET requests (object reads and listings)."""
        return [r["url"] for r in self.requests if r["method"] == "GET"]


_SERVER: S3Server | None = None


def configure_environment() -> S3Server:
    """Reserve the loopback endpoint and put the AWS settings in this process's environment (idempotent)."""
    global _SERVER
    if _SERVER is None:
        # A process spawned by a test (a driver of its own Ray cluster) imports this again: it must reach the
        # parent's server, on the parent's port.
        inherited = os.environ.get(PORT_ENV)
        inherited_proxy = os.environ.get(PROXY_PORT_ENV)
        if inherited and inherited_proxy:
            _SERVER = S3Server(int(inherited), int(inherited_proxy))
        else:  # held until start(), out of Ray's reach (tests/ports.py)
            moto_port, proxy_port = Reserved(), Reserved()
            _SERVER = S3Server(moto_port.port, proxy_port.port, held=moto_port, proxy_held=proxy_port)
        os.environ[PORT_ENV] = str(_SERVER.port)
        os.environ[PROXY_PORT_ENV] = str(_SERVER.faults.port)
        os.environ.update(
            {
                "AWS_ENDPOINT_URL": _SERVER.endpoint,
                "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": REGION,
                # Bounded retries, short enough for the fault tests (the defaults are 5 attempts, 5 s connects).
                "ZEPHON_RAY_S3_MAX_ATTEMPTS": "3",
                "ZEPHON_RAY_S3_CONNECT_TIMEOUT_S": "1",
            }
        )
        os.environ.pop("S3_ENDPOINT_URL", None)
        os.environ.pop("AWS_PROFILE", None)
    return _SERVER


def server() -> S3Server:
    return configure_environment().start()
