"""TorchTitan's real Trainer (llama3 debug model, CPU) under Ray Train: 2 workers to step 2, resumed by 1 worker
from ``ray.train.get_checkpoint()`` to step 4. Digests and losses equal the single-process reference.

Slow (two Ray Train runs of TorchTitan's imports: 37 s alone on 2 cores, up to 144 s beside other tests). CI
resumes the same Trainer at another W under torchrun
(tests/test_torchtitan_train.py::test_resume_at_another_world) and resumes Ray Train jobs at another W from
``ray.train.get_checkpoint()`` (tests/test_ray_train_quickstart.py, tests/test_ray_train_elastic.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_torchtitan_train import REFERENCE_LOSSES

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")


@pytest.mark.slow
def test_torchtitan_under_ray_train_2_to_1(ray_cluster, tmp_path, reference_digests):
    from examples.torchtitan_ray_train import TitanRun, fit, read_log

    log = str(tmp_path / "steps.jsonl")
    for world, until in ((2, 2), (1, 4)):
        run = TitanRun(
            recipe=TINY,
            run_id="titan-ray",
            dump_folder=str(tmp_path / "dump"),
            log_path=log,
            steps=until,
            checkpoint_every=2,
            mode="local",
            aggregate_store="torch://",
        )
        result = fit(run, workers=world, name="titan", storage_path=str(tmp_path / "ray-results"), cpu_per_worker=0.5)
        assert result.error is None, result.error
    records = read_log(log)
    assert [(r["step"], r["world"]) for r in records] == [(0, 2), (1, 2), (2, 1), (3, 1)]
    assert [r["digest"] for r in records] == reference_digests[:4]
    assert [r["loss"] for r in records] == pytest.approx(REFERENCE_LOSSES, abs=2e-5)
