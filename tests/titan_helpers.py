"""Test-side TorchTitan config registry: the CPU config of ``examples/torchtitan_cpu.py`` with a loader that records
every step's slice, so the tests can check the rows the real Trainer trained on (nothing here is in the wheel).

    PYTHONPATH=<repo>:<repo>/tests ZR_TEST_RECORD_DIR=/tmp/rec torchrun ... -m torchtitan.train \\
        --module titan_helpers --config zephon_llama3_debugmodel_cpu_recorded

Each rank writes ``step-<s>-rank-<r>-of-<W>.npz`` (tokens, positions) for every step it takes, taken from the
loader's ``steps()`` (the core's whole steps, each with its RankSlice); a TP/PP/CP peer does not write (its rows
are its leader's).
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
        peers = self.core.peers
        for batch in super().steps():
            if peers is None or peers.is_leader:
                piece = batch.slice
                path = Path(self.config.record_dir) / f"step-{piece.step:06d}-rank-{piece.rank:03d}-of-{piece.world:03d}.npz"
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp.npz")
                np.savez(tmp, tokens=piece.tokens, positions=piece.positions)
                os.replace(tmp, path)
            yield batch


def zephon_llama3_debugmodel_cpu_recorded():
    """``examples.torchtitan_cpu.zephon_llama3_debugmodel_cpu`` recording into ``$ZR_TEST_RECORD_DIR``."""
    config = zephon_llama3_debugmodel_cpu()
    loader = config.dataloader
    config.dataloader = RecordingLoader.Config(
        **{f.name: getattr(loader, f.name) for f in fields(ZephonRayDataLoader.Config) if f.init},
        record_dir=os.environ[ENV_RECORD_DIR])
    return config
