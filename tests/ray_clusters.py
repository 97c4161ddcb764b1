"""The tests' own Ray clusters, apart from the session's (tests/conftest.py's ``ray_cluster``): a ``ray start --head``
on held ports (:func:`ray_head`) and a multi-raylet ``ray.cluster_utils.Cluster`` for a spawned driver
(:func:`local_cluster`).

Usage::

    with ray_head("zrjob-") as head:          # a test or a fixture
        subprocess.run([RAY, "start", "--head", *head.flags], ...)
        ...                                   # head.gcs, head.dashboard

    with local_cluster("zr-x-", {"num_cpus": 2}) as (cluster, temp_dir):   # in the spawned driver
        cluster.add_node(num_cpus=2, temp_dir=temp_dir)
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": checkout_pythonpath()}}, ...)

Guarantee: each cluster lives in a temp dir of its own (short, under /tmp: Ray's socket paths must fit 107 bytes)
and is stopped by what names that dir, never by ``ray stop`` (which would stop every cluster on the machine); a head's
ports are held from before ``ray start`` until it is stopped (tests/ports.py), so no other process can take one in
between. Limit: a head's processes that outlive SIGTERM and SIGKILL for 5 s each fail the test that started it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.ports import held_ports

ROOT = Path(__file__).resolve().parents[1]


def checkout_pythonpath() -> str:
    """PYTHONPATH for a Ray job's workers: this checkout first (tests/ and examples/ import from it)."""
    return str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")


def pids_with(marker: str) -> list[int]:
    """Our cluster's processes: every Ray daemon and worker names its session/temp dir on its command line."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry))
    return pids


def stop_cluster(temp_dir: str) -> list[int]:
    """SIGTERM, then SIGKILL, every process that names ``temp_dir``; the pids found first."""
    pids = pids_with(temp_dir)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in pids_with(temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids_with(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
    return pids


def stop_quietly(service) -> None:
    """Stop ``service`` (when there is one) before its cluster goes; an error there would hide the test's own."""
    if service is not None:
        try:
            service.stop()
        except Exception:  # noqa: BLE001 - the cluster is shut down next
            pass


@dataclass(frozen=True)
class RayHead:
    """A private head's temp dir and ports; ``flags`` make ``ray start --head`` use them."""

    temp_dir: str
    gcs_port: int
    dashboard_port: int
    ports: tuple[int, ...]  # client server, node manager, object manager, agent, agent gRPC, metrics, runtime env

    @property
    def gcs(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"127.0.0.1:{self.dashboard_port}"

    @property
    def flags(self) -> list[str]:
        client, nm, om, agent, agent_grpc, metrics, rt_env = self.ports
        return [
            f"--temp-dir={self.temp_dir}",
            f"--port={self.gcs_port}",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={client}",
            f"--node-manager-port={nm}",
            f"--object-manager-port={om}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={rt_env}",
            "--disable-usage-stats",
        ]


@contextlib.contextmanager
def ray_head(prefix: str) -> Iterator[RayHead]:
    """A temp dir and nine held ports for a ``ray start --head`` the block runs; afterwards every process of that
    head is stopped, and one that survives fails the test."""
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    with held_ports(9) as (gcs, dashboard, *others):
        try:
            yield RayHead(temp_dir, gcs, dashboard, tuple(others))
        finally:
            killed = stop_cluster(temp_dir)
            leftover = pids_with(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
            assert not leftover, f"processes of our cluster survived: {leftover} (killed {killed})"


@contextlib.contextmanager
def local_cluster(prefix: str, head: dict, *, temp_dir: str | None = None) -> Iterator[tuple]:
    """A ``ray.cluster_utils.Cluster`` whose head node has ``head`` (its ``head_node_args``), for a driver in a
    process of its own (``run_spawned_driver``); yields ``(cluster, temp_dir)``: nodes added with ``temp_dir=temp_dir``
    share it. Without ``temp_dir`` a new one is made (and removed after), and RAY_TMPDIR points there, so Cluster
    records its address there, not in the shared /tmp/ray. On exit the driver's Ray connection is shut down, then
    the cluster."""
    import ray
    from ray.cluster_utils import Cluster

    made = temp_dir is None
    if made:
        temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        os.environ["RAY_TMPDIR"] = temp_dir
        os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**head, "temp_dir": temp_dir})
        yield cluster, temp_dir
    finally:
        try:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
        finally:
            if made:
                shutil.rmtree(temp_dir, ignore_errors=True)
