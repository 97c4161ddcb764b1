"""The ``--override.imports`` route through TorchTitan 0.3.0's own CLI parser and override machinery.

A stock config (``--module llama3 --config llama3_debugmodel``) never sets the loader's global batch; the override
hook reads the trainer config it is applied to and checks the global batch, seq_len and tokenizer against the
recipe, each failing with one line. The last test (slow) runs TorchTitan's real ``torchtitan.train`` entry point
(CPU shims on) so the error is shown to come out of ``Trainer.__init__`` itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
BYTES_ASSETS = ROOT / "zephon_ray" / "integrations" / "torchtitan" / "assets" / "bytes"
BPE_ASSETS = ROOT / "recipes" / "tokenizer"  # a 2048-token BPE: not the tiny recipe's byte tokenizer
OVERRIDE = f'zephon_ray.integrations.torchtitan.overrides.zephon_dataloader={{"recipe": "{TINY}", "mode": "local"}}'


def _cli(*extra: str) -> list[str]:
    return [
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--training.seq_len",
        "64",
        "--hf_assets_path",
        str(BYTES_ASSETS),
        "--override.imports",
        OVERRIDE,
        *extra,
    ]


def _apply(argv: list[str]):
    """What ``Trainer.__init__`` does with the CLI: parse, then apply the overrides to the whole config."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    config = ConfigManager().parse_args(argv)
    apply_overrides(config.override, config)
    return config


def _one_line_error(argv: list[str], match: str) -> str:
    from zephon_ray.integrations.torchtitan.trainer_checks import TrainerMismatchError

    with pytest.raises(TrainerMismatchError, match=match) as info:
        _apply(argv)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_right_geometry_and_tokenizer_pass_and_reach_the_loader(tmp_path):
    from zephon_ray.torchtitan import ZephonRayDataLoader

    config = _apply(_cli("--training.global_batch_size", "16", "--training.local_batch_size", "4"))
    assert isinstance(config.dataloader, ZephonRayDataLoader.Config)
    assert not isinstance(config.validator.dataloader, ZephonRayDataLoader.Config)  # the trainer's loader only
    assert config.dataloader.recipe == str(TINY) and config.dataloader.mode == "local"
    assert config.dataloader.global_batch_size == 16
    config.dataloader.aggregate_store, config.dataloader.aggregate_dir = None, str(tmp_path)  # no torchrun here
    # Built the way Trainer.__init__ builds it (its tokenizer included): dp=2 -> grad_accum 2.
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    with config.dataloader.build(
        dp_world_size=2, dp_rank=1, tokenizer=tokenizer, seq_len=64, local_batch_size=4, snapshot_every_n_steps=None
    ) as loader:
        assert loader.microbatches_per_step == 2


def test_wrong_global_batch_is_one_line():
    message = _one_line_error(
        _cli("--training.global_batch_size", "8"),
        "training.global_batch_size 8 is smaller than the recipe's global batch of 16 rows",
    )
    assert "tiny.toml" in message and "set training.global_batch_size = 16" in message


def test_unset_global_batch_is_checked_when_the_loader_is_built(tmp_path):
    """TorchTitan's -1 means local_batch_size x dp: it passes the config stage, then the build (which knows dp)
    rejects 8 x 1 rows."""
    from zephon_ray.integrations.torchtitan.trainer_checks import TrainerMismatchError

    config = _apply(_cli("--training.local_batch_size", "8"))
    assert config.dataloader.global_batch_size == -1
    config.dataloader.aggregate_store, config.dataloader.aggregate_dir = None, str(tmp_path)
    with pytest.raises(TrainerMismatchError, match=r"global batch 8 \(training.global_batch_size is -1"):
        config.dataloader.build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=8)
    config.dataloader.build(dp_world_size=2, dp_rank=0, seq_len=64, local_batch_size=8).close()  # 8 x 2 = 16


def test_wrong_tokenizer_is_one_line():
    message = _one_line_error(
        _cli("--training.global_batch_size", "16", "--hf_assets_path", str(BPE_ASSETS)),
        r"tokenizer .* differ: vocab size 2048 != 259",
    )
    assert "hf_assets_path" in message


def test_wrong_seq_len_is_one_line():
    _one_line_error(
        _cli("--training.global_batch_size", "16", "--training.seq_len", "128"),
        "training.seq_len 128 differs from the recipe's seq_len 64",
    )


def test_wrong_tokenizer_rejected_by_the_loader_build_on_any_route():
    """Same vocab size and special ids, other ids: the probe encoding catches it (no override involved)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from zephon_ray.integrations.torchtitan.trainer_checks import TrainerMismatchError
    from zephon_ray.torchtitan import ZephonRayDataLoader

    class ShiftedBytes(HuggingFaceTokenizer):  # a byte tokenizer that numbers the bytes differently
        def encode(self, *args, **kwargs):
            return [(i + 1) % 256 if i < 256 else i for i in super().encode(*args, **kwargs)]

    tokenizer = ShiftedBytes(tokenizer_path=str(BYTES_ASSETS))
    cfg = ZephonRayDataLoader.Config(recipe=str(TINY), mode="local")
    with pytest.raises(TrainerMismatchError, match="encode the probe text differently"):
        cfg.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=64, local_batch_size=4)
    good = HuggingFaceTokenizer(tokenizer_path=str(BYTES_ASSETS))
    cfg.build(dp_world_size=1, dp_rank=0, tokenizer=good, seq_len=64, local_batch_size=4).close()


_LAUNCH = """
import sys
import examples.torchtitan_cpu as cpu
cpu.apply()
from torchtitan.train import main
main()
"""


@pytest.mark.slow  # ~45 s on 2 cores: a torchrun and TorchTitan's imports, for one error line
def test_real_trainer_fails_on_the_override_route_with_the_geometry_line(tmp_path):
    """``torchrun ... torchtitan.train`` (its real main and Trainer, CPU shims on) with a wrong global batch."""
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCH)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        str(script),
        *_cli("--training.global_batch_size", "32", "--dump_folder", str(tmp_path / "dump")),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if "TrainerMismatchError:" in l]
    assert lines, proc.stderr[-3000:]
    assert "the trainer's global batch 32 differs from the recipe's global batch of 16 rows" in lines[-1]
    assert lines[-1].endswith("set training.global_batch_size = 16")
