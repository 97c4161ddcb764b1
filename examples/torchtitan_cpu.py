"""Run TorchTitan 0.3.0 on a CPU-only torch (2.13): for tests and examples only, never for real training.

Also a TorchTitan config registry (run from the repository root, so that ``examples`` is importable)::

    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 -m torchtitan.train --module examples.torchtitan_cpu \
        --config zephon_llama3_debugmodel_cpu --training.steps 4

:func:`zephon_llama3_debugmodel_cpu` is ``zephon_ray.integrations.torchtitan.config_registry``'s
``zephon_llama3_debugmodel`` (same environment knobs) with the shims on, a 2-layer model, DDP over gloo, no compile.

TorchTitan 0.3.0 assumes an accelerator. Small shims make its real ``Trainer`` train on CPU, with 1 rank or several
over gloo, pipeline (PP) and context parallelism (CP) included. Nothing else in zephon-ray knows about them:

1. ``torchtitan.trainer`` imports ``triton`` unconditionally: it must be installed (it imports without a GPU).
2. ``torchtitan.tools.utils`` falls back to ``"cuda"`` when no accelerator is found, and other modules copy
   ``device_type``/``device_module`` at import time. :func:`apply` rewrites them to ``"cpu"`` and a small
   stand-in device module in every torchtitan module already imported and in ``tools.utils`` itself, so it works
   even after ``torchtitan.train`` imported the trainer (which is what ``torchrun -m torchtitan.train`` does).
3. FlexAttention has no CPU backward. Its compiled kernel is swapped for eager ``scaled_dot_product_attention``
   with a dense mask evaluated from the BlockMask's ``mask_mod`` (O(seq_len^2) memory: fine for debug models),
   and the compiled ``create_block_mask`` for the eager one.
4. torch 2.13 has no ``torch.distributed.set_timeout``; it is routed to c10d's private ``_set_pg_timeout``.
5. Not a CPU matter, a version one (it would fail on a GPU with torch 2.13 too): TorchTitan 0.3.0 drives a pipeline
   schedule with per-microbatch lists, ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=,
   return_outputs=)``, while torch 2.13's public ``step`` takes the whole batch and splits it itself (the lists land
   in ``**kwargs`` and the schedule fails with "Expecting 8 arg_mbs but got 1"). torch 2.13 has the per-microbatch
   entry point as the private ``_step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
   loss_kwargs=)``: :func:`_patch_pipeline_step` routes such calls there, after the per-step reset ``step`` does.
6. TorchTitan turns FSDP's gradient division off (``set_gradient_divide_factor(1.0)``: it divides by the global token
   count itself), and FSDP then reduce-scatters with NCCL's ``PREMUL_SUM``, which gloo lacks ("Cannot use
   ReduceOp.PREMUL_SUM with Gloo"; FSDP is what CP shards its parameters with). :func:`_patch_fsdp_sum_reduction`
   makes that call also ask FSDP for plain-``SUM`` collectives (its public ``set_force_sum_reduction_for_comms``),
   which divide by the same factor, 1, after the reduction.

:func:`apply` is idempotent and does nothing when an accelerator is present (unless ``force=True``).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch

_APPLIED = False


def zephon_llama3_debugmodel_cpu():
    """CPU-only variant for tests and examples: shims on, 2-layer debug model, DDP over gloo, no compile."""
    apply()
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.config.configs import DebugConfig

    from zephon_ray.integrations.torchtitan.config_registry import zephon_llama3_debugmodel

    config = zephon_llama3_debugmodel()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = config.model_spec.model
    model.layers = model.layers[:2]
    config.parallelism = ParallelismConfig(
        data_parallel_replicate_degree=world,
        data_parallel_shard_degree=1,
        spmd_backend="partial_dtensor",
    )
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"
    config.compile = CompileConfig(enable=False)
    config.debug = DebugConfig(seed=0)
    return config


class _CpuDeviceModule(SimpleNamespace):
    """The few ``torch.cuda``-like calls TorchTitan makes on its device module."""

    def __init__(self) -> None:
        super().__init__()

    @staticmethod
    def set_device(*_: Any) -> None: ...

    @staticmethod
    def synchronize(*_: Any) -> None: ...

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def empty_cache() -> None: ...

    @staticmethod
    def reset_peak_memory_stats(*_: Any) -> None: ...

    @staticmethod
    def memory_stats(*_: Any) -> dict:
        return {}

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(*_: Any) -> Any:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return SimpleNamespace(name="cpu", total_memory=int(pages * page_size) or 1)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)


CPU_DEVICE_MODULE = _CpuDeviceModule()


def accelerator_available() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


def apply(*, force: bool = False) -> bool:
    """Install the four shims. Returns True when they are active."""
    global _APPLIED
    if _APPLIED:
        return True
    if accelerator_available() and not force:
        return False
    import triton  # noqa: F401 - shim 1: fail here, with a clear name, if it is missing

    _patch_device()
    _patch_flex_attention()
    _patch_set_timeout()
    _patch_pipeline_step()
    _patch_fsdp_sum_reduction()
    _APPLIED = True
    return True


def _patch_device() -> None:
    import torchtitan.tools.utils as tt_utils

    real_cuda = torch.cuda
    for name, module in list(sys.modules.items()):
        if not (name == "torchtitan" or name.startswith("torchtitan.")) or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is real_cuda:
            module.device_module = CPU_DEVICE_MODULE
    tt_utils.device_type = "cpu"
    tt_utils.device_module = CPU_DEVICE_MODULE


def _dense_mask(block_mask: Any, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    mask = block_mask.mask_mod(b, h, q, kv)
    return mask.expand(batch, 1, q_len, kv_len)


def _eager_flex_attention(
    q,
    k,
    v,
    *,
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_aux=None,
    kernel_options=None,
    **_: Any,
):
    from torch.nn.attention.flex_attention import AuxOutput

    if score_mod is not None:
        raise NotImplementedError("examples.torchtitan_cpu: score_mod is not supported by the CPU attention shim")
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[-2]
    mask = None if block_mask is None else _dense_mask(block_mask, batch, q_len, kv_len, q.device)
    if enable_gqa and k.shape[1] != heads:
        rep = heads // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scale_ = scale if scale is not None else head_dim**-0.5
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale_
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, AuxOutput(lse=lse if want_lse else None)


def _patch_flex_attention() -> None:
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    # Patch the static entry point, not only the ``_compiled_flex_attn`` class variable: TorchTitan's
    # ``set_determinism`` re-assigns that variable to a freshly compiled kernel.
    attention.FlexAttention._compiled_flex_attn = staticmethod(_eager_flex_attention)
    attention.FlexAttention.compiled_flex_attn = staticmethod(_eager_flex_attention)
    attention._compiled_create_block_mask = create_block_mask


def _patch_set_timeout() -> None:
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_timeout(timeout: timedelta, group: Any = None) -> None:
        _set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


def _patch_pipeline_step() -> None:
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if getattr(cls.step, "_zephon_ray_shim", False):
            continue
        cls.step = _per_microbatch_step(cls.step)


def _per_microbatch_step(whole_batch_step):
    def step(
        self,
        *args,
        arg_mbs=None,
        kwarg_mbs=None,
        target_mbs=None,
        losses=None,
        return_outputs=True,
        loss_kwargs=None,
        **kwargs,
    ):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:  # torch's own whole-batch call
            return whole_batch_step(
                self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs
            )
        if args or kwargs:
            raise TypeError(
                "examples.torchtitan_cpu: a pipeline step takes either per-microbatch lists or a whole batch, not both"
            )
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:  # what torch's step does before it splits the batch
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        if return_outputs:
            last = [stage for stage in stages if stage.is_last]
            if last:
                return self._merge_outputs(last[0].output_chunks)
        return None

    step._zephon_ray_shim = True
    return step


def _patch_fsdp_sum_reduction() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor
    if getattr(original, "_zephon_ray_shim", False):
        return

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)  # gloo has SUM, not PREMUL_SUM

    set_gradient_divide_factor._zephon_ray_shim = True
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor
