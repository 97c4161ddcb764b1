"""One-shot smoke test of zephon-ray's TorchTitan loader on one GPU (or on CPU with SMOKE_DEVICE=cpu).

Run from the repository root with PYTHONPATH=<wheels site>:$PWD (see scripts/gpu_smoke/gpu_smoke.sh):

  part 1 (pure CPU): ZephonRayDataLoader(mode="local", W=1, 2 microbatches per step) over recipes/tiny.toml; every
          step's digest must equal GlobalBatchSource(recipe).batch(s).digest and KNOWN_DIGESTS (the dev machine's).
  part 2: TorchTitan 0.3.0's real Trainer (llama3 debug model) fed by the loader, on SMOKE_DEVICE (default cuda),
          in a child process per variant (a crash or hang cannot lose part 1), each step's loss, batch digest and
          wall time printed:
            cpu_test_config:    examples.torchtitan_cpu.zephon_llama3_debugmodel_cpu(), the config
                                tests/test_torchtitan_train.py runs
                                (2 layers, fp32, partial_dtensor, no compile, no CUDA graphs), SMOKE_STEPS steps; on a
                                GPU its CPU shims stay off by themselves (cpu.apply() is a no-op with an accelerator);
                                FlexAttention compiled without max-autotune (SMOKE_FLEX_AUTOTUNE=1 keeps it);
            chunked_loss_probe: the same with TorchTitan's ChunkedLossWrapper kept, 2 steps, only with torch < 2.13
                                (expected to crash there: see use_unchunked_loss); SMOKE_CHUNKED_PROBE=0 skips it;
            stock:              zephon_llama3_debugmodel(), the accelerator config (TorchTitan defaults: 6 layers,
                                bf16 params, spmd_types backend, FSDP of degree 1, CUDA graphs on, FlexAttention
                                max-autotune), SMOKE_STEPS steps. GPU only; SMOKE_STOCK=0 skips it.
          torch 2.11 lacks a few things TorchTitan 0.3.0 uses: apply_torch_compat / apply_attention_compat /
          use_unchunked_loss fill them in (each is listed in the result when it applied).
  Summary: $OUT/gpu_smoke.json (or ./gpu_smoke.json); a compact one-line GPU_SMOKE_SUMMARY is printed last.
  Exit status 0 when part 1 and cpu_test_config passed (the other variants are informational).

SMOKE_MODE=service: part 2's loader reads from a DataService (2 producers) that this script starts on a private local
Ray before the variants run (ZEPHON_RAY_MODE=service; the Trainer's child attaches through RAY_ADDRESS); part 1 stays
in local mode.

Environment: SMOKE_MODE (local|service), SMOKE_DEVICE (cuda|cpu), SMOKE_STEPS (10), SMOKE_DATA_STEPS (6), SMOKE_STOCK (1),
SMOKE_CHUNKED_PROBE (1), SMOKE_STOCK_NO_CUDA_GRAPHS (0), SMOKE_UNCHUNKED_LOSS (auto|0|1), SMOKE_FLEX_AUTOTUNE (0), SMOKE_AC (debug: none|full),
SMOKE_TRAIN_TIMEOUT (240 s per variant), SMOKE_BUDGET (360 s: a variant gets at most what is left of it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path

T0 = float(os.environ.get("SMOKE_T0") or time.time())
os.environ["SMOKE_T0"] = repr(T0)  # children log on the parent's clock
ROOT = Path.cwd()
RECIPE = ROOT / "recipes" / "tiny.toml"
OUT = Path(os.environ.get("OUT") or ROOT)
DEVICE = os.environ.get("SMOKE_DEVICE", "cuda")
STEPS = int(os.environ.get("SMOKE_STEPS", "10"))
DATA_STEPS = int(os.environ.get("SMOKE_DATA_STEPS", "6"))
TRAIN_TIMEOUT = int(os.environ.get("SMOKE_TRAIN_TIMEOUT", "240"))
BUDGET = int(os.environ.get("SMOKE_BUDGET", "360"))

# `zephon-ray digest recipes/tiny.toml --steps 0:10` on the dev machine (zephon 0.2.0): global batch s is a pure
# function of (recipe, s), so this machine must produce the same rows. (Losses are not compared across machines:
# the model's initial weights depend on the torch version and the device's RNG; dev-machine CPU losses, 10 steps of
# cpu_test_config: torch 2.13.0+cpu 8.2026 7.9790 7.6423 7.1837 6.6865 6.0648 5.5427 5.4351 5.1580 5.3211;
# torch 2.11.0 (unchunked loss) 8.1169 7.9177 7.5417 7.1464 6.6087 6.0492 5.6263 5.4594 5.2638 5.3576.)
KNOWN_DIGESTS: list[str] = [
    "753709a034370e333069efe3a577c40dcc4ebed33525cbd83246d58cf6b34b87",
    "a83c7fa69e2229ccb7205e111536daca63969f93bb7f7cb4d3a16dda76da230f",
    "3a83aaa5cd8e960d445edbd487c8396295dcf9749e9e9d995edd6cdd50cdf3df",
    "9ffd11ad58f306abbf8bd58738103a192f388a8401bd98929acbd399137b1558",
    "696544fe4f20dff4fa2ecfdbf246f9add97e6579edda7abd362737558c371780",
    "41e1c41a90da89fb9bf9b1d0f58b9b4d44040aabc26e1ce82542ef4845f2f39a",
    "0af1af64000b55a34edbd2d9cb9b1e31317e7fc692dc15bfe395de5527dd8587",
    "88de1751df2cb3d7b9d9478613d266e4366b400cb1a1bb976a1d5ef581725252",
    "ec43160c94b6cf7b06fe7c62dbb2b4fa99aa8771e4d0845ec9375a3d3ffa31a9",
    "26d016c6a0ae15f17b5089662e007823eae86a5546f71225e69a7c18f9719e8d",
]


def log(msg: str) -> None:
    print(f"[smoke {time.time() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- torch compat shims
def apply_torch_compat() -> list[str]:
    """TorchTitan 0.3.0 was built against a newer torch than 2.11: fill in what it imports but 2.11 lacks.

    * ``torch.distributed.fsdp.DataParallelMeshDims`` (imported at module level by torchtitan.distributed; only
      ever passed to ``fully_shard`` when FSDP/HSDP spans more than one mesh axis of size > 1, never on one GPU);
    * ``torch.distributed.set_timeout`` (called after step 1; also absent in torch 2.13, see
      examples/torchtitan_cpu.py shim 4): routed to c10d's private ``_set_pg_timeout``."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    applied = []
    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclass
        class DataParallelMeshDims:  # the torch 2.13 definition's fields and checks
            shard: str | tuple[str, ...] | None = None
            replicate: str | tuple[str, ...] | None = None

            def __post_init__(self):
                if self.shard is None and self.replicate is None:
                    raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

            @property
            def shard_names(self) -> tuple[str, ...]:
                return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

            @property
            def replicate_names(self) -> tuple[str, ...]:
                r = self.replicate
                return () if r is None else (r,) if isinstance(r, str) else tuple(r)

        DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        applied.append("torch.distributed.fsdp.DataParallelMeshDims (stub dataclass)")
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        def set_timeout(timeout, group=None):
            _set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout
        applied.append("torch.distributed.set_timeout -> distributed_c10d._set_pg_timeout")
    return applied


def apply_attention_compat(variant: str) -> list[str]:
    """Run after the Trainer config is made (the CPU shims replace ``_compiled_create_block_mask`` when they apply).

    * torch 2.11's ``create_block_mask`` has no ``separate_full_blocks`` keyword (2.13 added it, default True; its
      2.11 behaviour is True, always), but TorchTitan 0.3.0 passes ``separate_full_blocks=not batch_invariant``:
      drop it when True, refuse False (batch-invariant mode, never on here).
    * cpu_test_config on a GPU: FlexAttention is compiled without max-autotune (TorchTitan turns it on, which spends
      minutes benchmarking kernels); the stock variant keeps TorchTitan's inductor options.
    """
    import inspect

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    applied = []
    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        inner = attention._compiled_create_block_mask

        def create_block_mask_compat(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError("torch < 2.13 create_block_mask always separates full blocks")
            return inner(*args, **kwargs)

        attention._compiled_create_block_mask = create_block_mask_compat
        applied.append("create_block_mask: drop separate_full_blocks=True (torch 2.11 lacks the keyword)")
    import examples.torchtitan_cpu as cpu

    if variant == "cpu_test_config" and not cpu._APPLIED and os.environ.get("SMOKE_FLEX_AUTOTUNE", "0") != "1":
        options = {**attention.FlexAttention.inductor_configs, "max_autotune": False,
                   "coordinate_descent_tuning": False}
        attention.FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=options)
        applied.append("FlexAttention compiled without max_autotune/coordinate_descent_tuning (SMOKE_FLEX_AUTOTUNE=1 "
                       "keeps them)")
    return applied


def use_unchunked_loss(config, variant: str, torch_version: str) -> str:
    """TorchTitan 0.3.0's ChunkedLossWrapper runs lm_head's backward in chunks inside the forward (a first
    ``backward``), then the decoder's backward. With torch 2.11's FSDP2 (TorchTitan applies ``fully_shard`` even at
    dp_shard=1), the first backward's final callback reshards the root FSDP group, freeing the final norm weight's
    unsharded storage that the decoder backward still needs: measured here on CPU with torch 2.11.0, the second
    backward's ``MulBackward0`` reads a Parameter with 0 bytes of storage and the process dies with SIGSEGV (torch
    2.13 keeps the storage: 1024 bytes, trains). So with torch < 2.13 the loss is the wrapped CrossEntropyLoss,
    unchunked (the same value; the model keeps its lm_head). SMOKE_UNCHUNKED_LOSS=0/1 forces it; the
    ``chunked_loss_probe`` variant keeps the chunked loss to show the failure on this machine."""
    from torchtitan.components.loss import ChunkedLossWrapper

    mode = os.environ.get("SMOKE_UNCHUNKED_LOSS", "auto")
    major_minor = tuple(int(x) for x in torch_version.split("+")[0].split(".")[:2])
    unchunk = mode == "1" or (mode == "auto" and major_minor < (2, 13))
    if variant == "chunked_loss_probe":
        unchunk = False
    if not isinstance(config.loss, ChunkedLossWrapper.Config):
        return f"{type(config.loss).__qualname__} (as configured)"
    if not unchunk:
        return "ChunkedLossWrapper(CrossEntropyLoss) (as configured)"
    config.loss = config.loss.loss_fn
    return (f"CrossEntropyLoss, unwrapped from the config's ChunkedLossWrapper (torch {torch_version}: see "
            "use_unchunked_loss)")


def ensure_datasets() -> str:
    """torchtitan.trainer imports torchtitan.hf_datasets, which imports HF ``datasets`` at module level (used only by
    TorchTitan's own HF loaders, never by ours). The carried datasets 4.7.0 wheel should import; if it does not on
    this machine (a dependency version), a stub module lets TorchTitan import, and the summary says so."""
    import types

    try:
        import datasets  # noqa: F401

        return f"datasets {datasets.__version__}"
    except Exception as exc:  # noqa: BLE001
        for name in [m for m in sys.modules if m == "datasets" or m.startswith("datasets.")]:
            del sys.modules[name]
        ds = types.ModuleType("datasets")
        dd = types.ModuleType("datasets.distributed")

        def unavailable(*_a, **_k):
            raise RuntimeError("HF datasets is stubbed out in this smoke run")

        ds.Dataset = type("Dataset", (), {})
        ds.IterableDataset = type("IterableDataset", (), {})
        ds.load_dataset = unavailable
        dd.split_dataset_by_node = unavailable
        ds.distributed = dd
        sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dd
        return f"STUB (import datasets failed: {type(exc).__name__}: {exc})"


def versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0], "executable": sys.executable}
    for name in ("torch", "triton", "zephon", "torchtitan", "torchdata", "torch_checkpointing", "spmd_types", "tyro",
                 "tokenizers", "numpy", "pyarrow", "typing_extensions", "optree", "datasets"):
        try:
            out[name] = metadata.version(name)
        except Exception:  # noqa: BLE001
            out[name] = None
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001
        out["torch_error"] = repr(exc)
    return out


# ---------------------------------------------------------------------------------------------- part 1: data
def part_data() -> dict:
    shims = apply_torch_compat()  # zephon_ray.integrations.torchtitan.loader imports torchtitan
    from zephon_ray import GlobalBatchSource, Recipe, compute_digest
    from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader

    res: dict = {"ok": False, "steps": DATA_STEPS, "compat_shims": shims, "datasets": ensure_datasets()}
    t = time.time()
    recipe = Recipe.from_toml(RECIPE)
    B = recipe.global_batch_rows
    lbs = B // 2  # two microbatches per step: the grad-accumulation path
    res.update(recipe=str(RECIPE.relative_to(ROOT)), rows=B, seq_len=recipe.seq_len, lanes=recipe.lanes,
               local_batch_size=lbs, fingerprint=recipe.fingerprint)
    with GlobalBatchSource(recipe) as src:
        expected = [src.batch(s).digest for s in range(DATA_STEPS)]
    res["source_s"] = round(time.time() - t, 2)
    t = time.time()
    loader = ZephonRayDataLoader(ZephonRayDataLoader.Config(recipe=str(RECIPE), mode="local"),
                                 dp_world_size=1, dp_rank=0, local_batch_size=lbs, seq_len=recipe.seq_len)
    got = []
    try:
        it = loader.steps()  # whole steps: the microbatches and the RankSlice they were cut from
        for s in range(DATA_STEPS):
            batch = next(it)
            shapes = [list(inputs["input"].shape) for inputs, _ in batch.microbatches]
            piece = batch.slice
            assert piece.step == s, (piece.step, s)
            d = compute_digest(piece.tokens, piece.positions)
            got.append(d)
            known = KNOWN_DIGESTS[s] if s < len(KNOWN_DIGESTS) else None
            log(f"data step {s}: loader {d[:16]}  source {expected[s][:16]}  "
                f"{'MATCH' if d == expected[s] else 'MISMATCH'}"
                f"{'' if known is None else ' dev-machine ' + ('MATCH' if known == d else 'MISMATCH')}  "
                f"microbatches {shapes}")
        state = loader.state_dict()
    finally:
        loader.close()
    res["loader_s"] = round(time.time() - t, 2)
    res["digests"] = got
    res["expected"] = expected
    res["match_source"] = got == expected
    n = min(len(got), len(KNOWN_DIGESTS))
    res["match_dev_machine"] = (got[:n] == KNOWN_DIGESTS[:n]) if n else None
    res["state_next_step"] = state.get("next_step")
    res["ok"] = res["match_source"] and res["match_dev_machine"] is not False and state.get("next_step") == DATA_STEPS
    return res


# ---------------------------------------------------------------------------------------------- part 2: trainer
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_child(variant: str, result_path: str, steps_n: int) -> None:
    """Runs in a child process: build the Trainer, train ``steps_n`` steps, write the result JSON."""
    res: dict = {"variant": variant, "device": DEVICE, "ok": False, "steps_planned": steps_n}

    def dump():
        Path(result_path).write_text(json.dumps(res, indent=1))

    try:
        res["compat_shims"] = apply_torch_compat()
        res["datasets"] = ensure_datasets()
        log(f"[{variant}] torch compat shims: {res['compat_shims'] or 'none needed'}")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()), ZEPHON_RAY_RECIPE=str(RECIPE))
        os.environ.pop("ZEPHON_RAY_AGGREGATE_DIR", None)
        import torch

        if DEVICE == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("SMOKE_DEVICE=cuda but torch.cuda.is_available() is False")
        t = time.time()
        from torchtitan.tools.logging import init_logger

        init_logger()
        import zephon_ray.integrations.torchtitan.config_registry as registry
        from zephon_ray import GlobalBatchSource, Recipe, compute_digest
        import examples.torchtitan_cpu as cpu

        res["import_s"] = round(time.time() - t, 2)
        if variant == "stock":
            config = registry.zephon_llama3_debugmodel()
            if DEVICE == "cpu":  # local testing only (SMOKE_STOCK=force): CPU shims, no CUDA graphs on CPU
                cpu.apply()
                config.training.disable_cuda_graphs = True
            elif os.environ.get("SMOKE_STOCK_NO_CUDA_GRAPHS") == "1":  # document masks change every step
                config.training.disable_cuda_graphs = True
        else:  # cpu_test_config, chunked_loss_probe
            config = cpu.zephon_llama3_debugmodel_cpu()  # installs the CPU shims only without an accelerator
        res["cpu_shims_active"] = cpu._APPLIED
        attn = apply_attention_compat(variant)
        res["compat_shims"] += attn
        log(f"[{variant}] CPU shims active: {cpu._APPLIED}; attention compat: {attn or 'none needed'}")
        import torchtitan.tools.utils as tt_utils

        res["torchtitan_device_type"] = tt_utils.device_type
        if DEVICE == "cuda" and tt_utils.device_type != "cuda":
            raise RuntimeError(f"torchtitan picked device_type {tt_utils.device_type!r}, not cuda")
        dump_dir = tempfile.mkdtemp(prefix=f"smoke-{variant}-")
        config.training.steps = steps_n
        config.dump_folder = dump_dir
        res["loss"] = use_unchunked_loss(config, variant, torch.__version__)
        log(f"[{variant}] loss: {res['loss']}")
        config.checkpoint.enable = False
        ac = os.environ.get("SMOKE_AC", "")  # debugging knob: "none" or "full" instead of the config's SelectiveAC
        if ac == "none":
            config.activation_checkpoint = None
        elif ac == "full":
            from torchtitan.distributed.activation_checkpoint import FullAC

            config.activation_checkpoint = FullAC.Config()
        tr = config.training
        par = config.parallelism
        res["config"] = {"layers": len(config.model_spec.model.layers), "global_batch_size": tr.global_batch_size,
                         "local_batch_size": tr.local_batch_size, "seq_len": tr.seq_len,
                         "mixed_precision_param": tr.mixed_precision_param, "disable_cuda_graphs": tr.disable_cuda_graphs,
                         "compile": config.compile.enable, "spmd_backend": par.spmd_backend,
                         "activation_checkpoint": type(config.activation_checkpoint).__qualname__,
                         "dp_replicate": par.data_parallel_replicate_degree, "dp_shard": par.data_parallel_shard_degree}
        log(f"[{variant}] config {res['config']}")
        with GlobalBatchSource(Recipe.from_toml(RECIPE)) as src:
            expected = [src.batch(s).digest for s in range(steps_n)]
        t = time.time()
        trainer = config.build()
        res["build_s"] = round(time.time() - t, 2)
        res["model_device"] = str(next(trainer.model_parts[0].parameters()).device)
        log(f"[{variant}] Trainer built in {res['build_s']} s; model on {res['model_device']}")
        loader = trainer.dataloader
        res["loader"] = type(loader).__name__
        res["loader_mode"] = loader.core.config.mode  # local, or service under SMOKE_MODE=service
        log(f"[{variant}] loader {res['loader']} in {res['loader_mode']} mode")
        steps: list[dict] = []
        res["steps"] = steps
        real_log = trainer.metrics_processor.log
        last = [time.perf_counter()]
        real_steps, taken = loader.steps, {}

        def recorded_steps():  # keep the RankSlice of the step the trainer is on, for its digest
            for batch in real_steps():
                taken["slice"] = batch.slice
                yield batch

        loader.steps = recorded_steps

        def log_step(step, global_avg_loss, *args, **kwargs):
            now = time.perf_counter()
            piece = taken["slice"]
            d = compute_digest(piece.tokens, piece.positions)
            s = step - 1
            rec = {"step": step, "batch": s, "loss": float(global_avg_loss), "digest": d,
                   "digest_ok": d == expected[s], "wall_s": round(now - last[0], 4)}
            last[0] = now
            steps.append(rec)
            if s < len(KNOWN_DIGESTS):
                rec["digest_dev_machine_ok"] = d == KNOWN_DIGESTS[s]
            log(f"[{variant}] step {step:2d} loss {rec['loss']:.6f} batch {s} digest {d[:16]} "
                f"{'MATCH' if rec['digest_ok'] else 'MISMATCH'}"
                f"{'' if s >= len(KNOWN_DIGESTS) else ' dev-machine ' + ('MATCH' if rec['digest_dev_machine_ok'] else 'MISMATCH')}"
                f" wall {rec['wall_s']:.3f}s")
            return real_log(step, global_avg_loss, *args, **kwargs)

        trainer.metrics_processor.log = log_step
        t = time.time()
        try:
            trainer.train()
        finally:
            trainer.close()
            loader.close()
        res["train_s"] = round(time.time() - t, 2)
        if DEVICE == "cuda":
            res["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        walls = [r["wall_s"] for r in steps[1:]]
        res["steady_step_wall_s"] = round(sorted(walls)[len(walls) // 2], 4) if walls else None
        res["digests_ok"] = len(steps) == steps_n and all(r["digest_ok"] and r.get("digest_dev_machine_ok", True)
                                                          for r in steps)
        losses = [r["loss"] for r in steps]
        res["losses_finite"] = all(x == x and abs(x) < 1e4 for x in losses)
        res["ok"] = res["digests_ok"] and res["losses_finite"]
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    except BaseException as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-6000:]
        log(f"[{variant}] FAILED: {res['error']}")
        traceback.print_exc()
    finally:
        dump()


def run_variant(variant: str, steps_n: int, max_timeout: int) -> dict:
    left = BUDGET - (time.time() - T0)
    timeout = int(min(max_timeout, left))
    if timeout < 45:
        log(f"--- part 2 [{variant}]: skipped, only {left:.0f} s of SMOKE_BUDGET left")
        return {"variant": variant, "ok": False, "skipped": f"only {left:.0f} s of SMOKE_BUDGET left"}
    result_path = OUT / f"gpu_smoke_{variant}.json"
    log_path = OUT / f"gpu_smoke_{variant}.log"
    log(f"--- part 2 [{variant}]: TorchTitan Trainer on {DEVICE}, {steps_n} steps (timeout {timeout} s, "
        f"full log {log_path})")
    result_path.unlink(missing_ok=True)
    t = time.time()
    tail: deque[str] = deque(maxlen=40)
    with open(log_path, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-u", __file__, "--train", variant, str(result_path), str(steps_n)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=False)
        try:
            deadline = time.time() + timeout
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                if time.time() > deadline:
                    raise subprocess.TimeoutExpired(proc.args, timeout)
                if not sel.select(timeout=1.0):
                    if proc.poll() is not None:
                        break
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                fh.write(line)
                tail.append(line.rstrip())
                if line.startswith("[smoke") or "Error" in line or "error:" in line:
                    print(line.rstrip()[:400], flush=True)
            rc = proc.wait(timeout=max(5, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
            proc.wait()
    res = {"variant": variant, "ok": False}
    if result_path.exists():
        try:
            res = json.loads(result_path.read_text())
        except ValueError:
            pass
    res["rc"] = rc
    res["wall_s"] = round(time.time() - t, 1)
    if rc != 0 and res.get("ok"):
        res["exit_note"] = f"the child finished its steps and wrote its result, then exited with {rc}"
        log(f"[{variant}] {res['exit_note']}")
    elif rc != 0:
        res["ok"] = False
        res.setdefault("error", f"child exited with {rc}")
        text = log_path.read_text(errors="replace")
        crash = text.rfind("Current thread")  # a faulthandler dump (SIGSEGV...): the crashing thread's frames
        if "Fatal Python error" in text and crash >= 0:
            shown = text[crash:].splitlines()[:7]
            log(f"[{variant}] child exit {rc}; innermost frames of the crashing thread (full dump in {log_path.name}):")
        else:
            shown = [x for x in tail if x.strip()][-12:]
            log(f"[{variant}] child exit {rc}; last lines (all of them in {log_path.name}):")
        res["log_tail"] = shown
        for line in shown:
            print("    " + line[:200], flush=True)
    return res


def start_service() -> dict:
    """SMOKE_MODE=service: a private Ray and a DataService on the recipe; the variants' loaders read from it."""
    import ray

    from zephon_ray import DataService

    t = time.time()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    run_id = os.environ.setdefault("ZEPHON_RAY_RUN_ID", "zephon-llama3-debug")
    service = DataService.start(str(RECIPE), name="gpu-smoke", namespace="zephon-ray", producers=2, run_id=run_id)
    os.environ.update(RAY_ADDRESS=ray.get_runtime_context().gcs_address, ZEPHON_RAY_MODE="service",
                      ZEPHON_RAY_SERVICE="gpu-smoke", ZEPHON_RAY_NAMESPACE="zephon-ray")
    return {"start_s": round(time.time() - t, 2), "status": {k: v for k, v in service.status().items()
                                                             if k in ("producers", "window", "run_id")}}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    summary: dict = {"device": DEVICE, "steps": STEPS}
    out_path = OUT / "gpu_smoke.json"

    def save():
        out_path.write_text(json.dumps(summary, indent=1, default=str))

    summary["versions"] = versions()
    log(f"versions {json.dumps(summary['versions'])}")
    log(f"--- part 1: ZephonRayDataLoader mode=local W=1 vs GlobalBatchSource, {DATA_STEPS} steps")
    try:
        summary["data"] = part_data()
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exc()
        summary["data"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    log(f"part 1 ok: {summary['data'].get('ok')}")
    save()
    summary["train"] = {}
    summary["mode"] = os.environ.get("SMOKE_MODE", "local")
    if summary["mode"] == "service":
        try:
            summary["service"] = start_service()
            log(f"service started: {summary['service']}")
        except BaseException as exc:  # noqa: BLE001
            traceback.print_exc()
            summary["service"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            save()
            return 1
    # Most important first: each later variant only gets the budget that is left.
    variants = [("cpu_test_config", STEPS, TRAIN_TIMEOUT)]
    if os.environ.get("SMOKE_CHUNKED_PROBE", "1") != "0":
        import torch

        if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
            variants.append(("chunked_loss_probe", 2, 100))
    if (DEVICE == "cuda" and os.environ.get("SMOKE_STOCK", "1") != "0") or os.environ.get("SMOKE_STOCK") == "force":
        variants.append(("stock", STEPS, TRAIN_TIMEOUT))
    for variant, steps_n, max_timeout in variants:
        summary["train"][variant] = run_variant(variant, steps_n, max_timeout)
        save()
    summary["ok"] = bool(summary["data"].get("ok")) and bool(summary["train"]["cpu_test_config"].get("ok"))
    summary["total_s"] = round(time.time() - T0, 1)
    save()
    # Compact summary last (the full one, with every digest and traceback, is in gpu_smoke.json).
    compact = {"ok": summary["ok"], "total_s": summary["total_s"], "device": DEVICE, "mode": summary["mode"],
               "versions": {k: summary["versions"].get(k) for k in ("torch", "torch_cuda", "gpu", "torchtitan",
                                                                     "zephon", "triton", "python")},
               "data": {k: summary["data"].get(k) for k in ("ok", "match_source", "match_dev_machine", "error")},
               "train": {}}
    for v, r in summary["train"].items():
        compact["train"][v] = {k: r.get(k) for k in ("ok", "rc", "error", "skipped", "exit_note", "compat_shims", "loss", "datasets", "cpu_shims_active",
                                                     "model_device", "build_s", "train_s", "steady_step_wall_s",
                                                     "digests_ok",
                                                     "max_memory_allocated_mib", "loader_mode") if k in r}
        compact["train"][v]["losses"] = [round(s["loss"], 5) for s in r.get("steps", [])]
        compact["train"][v]["step_wall_s"] = [round(s["wall_s"], 3) for s in r.get("steps", [])]
    log(f"summary written to {out_path}")
    print("GPU_SMOKE_SUMMARY " + json.dumps(compact, default=str), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--train":
        train_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the result is written; skip interpreter teardown (loader threads, process groups)
    sys.exit(main())
