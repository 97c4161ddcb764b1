"""Test-side TorchTitan config registry: the CPU config of ``examples/torchtitan_cpu.py`` with a loader that records
every step's slice, so the tests can check the rows the real Trainer trained on (nothing here is in the wheel).

    PYTHONPATH=<repo>:<repo>/tests ZR_TEST_RECORD_DIR=/tmp/rec torchrun ... -m torchtitan.train \\
        --module titan_helpers --config zephon_llama3_debugmodel_cpu_recorded

Each dp rank writes ``step-<s>-rank-<r>-of-<W>.npz`` (tokens, positions) for every step it takes, taken from the
loader's ``steps()`` (the core's whole steps, each with its RankSlice): the local-mode leader of its TP/PP/CP peers,
or in service and dataset mode every peer (the same rows, each written atomically). When the job has more processes
than dp ranks, every process also writes what it got as ``ranks/step-<s>-global-<g>-of-<N>-dp-<r>-of-<W>.npz``,
with the dp rank and degree TorchTitan built its loader with, so a test can check each peer's rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from examples.torchtitan_cpu import zephon_llama3_debugmodel_cpu
from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader
from zephon_ray.stream.loader import StepBatch

ENV_RECORD_DIR = "ZR_TEST_RECORD_DIR"


class RecordingLoader(ZephonRayDataLoader):
    """``ZephonRayDataLoader`` that writes every step's slice to ``record_dir`` before handing the step out."""

    @dataclass(kw_only=True, slots=True)
    class Config(ZephonRayDataLoader.Config):
        record_dir: str = ""

    def steps(self) -> Iterator[StepBatch]:
        import torch.distributed as dist

        peers = self.core.peers
        me, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        record = Path(self.config.record_dir)
        for batch in super().steps():
            piece = batch.slice
            if peers is None or peers.is_leader:
                _save(record / f"step-{piece.step:06d}-rank-{piece.rank:03d}-of-{piece.world:03d}.npz", piece)
            if world > self.dp_world_size:
                _save(
                    record
                    / "ranks"
                    / (
                        f"step-{piece.step:06d}-global-{me:03d}-of-{world:03d}-dp-"
                        f"{self.dp_rank:03d}-of-{self.dp_world_size:03d}.npz"
                    ),
                    piece,
                )
            yield batch


def _save(path: Path, piece) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # peers may write the same file: one tmp each
    with open(tmp, "wb") as f:
        np.savez(f, tokens=piece.tokens, positions=piece.positions)
    os.replace(tmp, path)


def zephon_llama3_debugmodel_cpu_recorded():
    """``examples.torchtitan_cpu.zephon_llama3_debugmodel_cpu`` recording into ``$ZR_TEST_RECORD_DIR``."""
    config = zephon_llama3_debugmodel_cpu()
    loader = config.dataloader
    config.dataloader = RecordingLoader.Config(
        **{f.name: getattr(loader, f.name) for f in fields(ZephonRayDataLoader.Config) if f.init},
        record_dir=os.environ[ENV_RECORD_DIR],
    )
    return config
