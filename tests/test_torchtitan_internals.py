"""Fails loudly when TorchTitan changes under zephon-ray: the private internals fenced in
``zephon_ray.integrations.torchtitan.internals``, the loader contract of ``Trainer.__init__``, and the private
targets of the CPU shims (examples/torchtitan_cpu.py, outside the wheel). Each assert says what to re-read."""

from __future__ import annotations

import ast
import inspect
import textwrap
from importlib import metadata

import pytest

from zephon_ray.integrations.torchtitan import internals


def test_torchtitan_is_the_version_the_internals_were_read_from():
    installed = metadata.version("torchtitan")
    assert installed == internals.TORCHTITAN_VERSION, (
        f"TorchTitan {installed} is installed, but zephon_ray/integrations/torchtitan/internals.py was written "
        f"against {internals.TORCHTITAN_VERSION}: re-read apply_overrides and Trainer.__init__, then update it"
    )


def test_apply_overrides_frame_walk_finds_the_trainer_config():
    """Run TorchTitan's real apply_overrides with an override whose factory does the walk."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.config.override import OverrideConfig, apply_overrides, override
    from torchtitan.trainer import Trainer

    assert internals.APPLY_OVERRIDES_ROOT in inspect.signature(apply_overrides).parameters, (
        f"apply_overrides no longer has a {internals.APPLY_OVERRIDES_ROOT!r} parameter: the frame walk is broken"
    )
    seen = {}

    @override(target=BaseDataLoader.Config, fqns=["dataloader"], description="zephon-ray internals probe")
    def probe(cfg, **kwargs):
        seen["root"] = internals.trainer_config_being_overridden()
        return cfg

    config = Trainer.Config()
    apply_overrides(OverrideConfig(imports=[f"{__name__}.probe"]), config)
    assert seen.get("root") is config


def test_the_walk_outside_apply_overrides_says_so():
    from zephon_ray.stream.geometry import TrainerMismatchError

    with pytest.raises(TrainerMismatchError, match="cannot find the trainer config this override is applied to"):
        internals.trainer_config_being_overridden()


def _dataloader_build_call():
    from torchtitan.trainer import Trainer

    tree = ast.parse(textwrap.dedent(inspect.getsource(Trainer.__init__)))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "build"
        and ast.unparse(n.func.value) == "config.dataloader"
    ]
    assert len(calls) == 1, "Trainer.__init__ no longer calls config.dataloader.build(...) exactly once"
    return calls[0]


def test_trainer_builds_the_loader_with_exactly_our_keywords():
    from zephon_ray.torchtitan import ZephonRayDataLoader

    call = _dataloader_build_call()
    theirs = {k.arg for k in call.keywords}
    ours = {
        name
        for name, p in inspect.signature(ZephonRayDataLoader.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert theirs == ours, f"Trainer.__init__ builds the data loader with {sorted(theirs)}, we accept {sorted(ours)}"
    # snapshot_every_n_steps counts microbatches of a rank: the loader divides it by its microbatches per step.
    snapshot = next(k.value for k in call.keywords if k.arg == "snapshot_every_n_steps")
    text = ast.unparse(snapshot)
    assert "checkpoint.interval" in text and "gradient_accumulation_steps" in text, text


def test_the_cpu_shims_private_targets_exist():
    """examples/torchtitan_cpu.py patches these; a rename would make the CPU tests fail obscurely."""
    import torch.distributed.distributed_c10d as c10d
    import torchtitan.tools.utils as tt_utils
    from torchtitan.models.common import attention

    assert hasattr(tt_utils, "device_type") and hasattr(tt_utils, "device_module")
    assert hasattr(attention.FlexAttention, "_compiled_flex_attn")
    assert hasattr(attention, "_compiled_create_block_mask")
    assert hasattr(c10d, "_set_pg_timeout")


def test_model_forward_takes_no_extra_input_keys():
    """Why ZephonRayDataLoader keeps ``source_ids`` out of the input dict (``pop_source_ids`` instead): TorchTitan
    0.3's trainer passes every key but ``input`` to ``model.forward``, and its Decoder's forward takes none but
    ``positions`` and ``attention_masks``."""
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.trainer import Trainer

    params = inspect.signature(Decoder.forward).parameters
    assert list(params) == ["self", "tokens", "positions", "attention_masks"]
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    source = inspect.getsource(Trainer.post_dataloading_process)
    assert 'k: v for k, v in input_dict.items() if k != "input"' in source
