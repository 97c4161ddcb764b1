"""A tiny bigram language model trained under Ray Train from ``ray.train.get_dataset_shard`` (zephon_ray.ray_train).

Also home of :func:`global_digest` (the examples' and tests' way to check a step's rows across ranks; not part of
the wheel).

Used by ``examples/elastic_resume.py`` (the fast default of ``make demo``) and by the Ray Train tests. The loop
scales each rank's summed token loss by ``batch.loss_scale("sum")`` (one over the global batch's valid tokens) and
sums gradients over gloo, so its losses and gradients are the same at every W, a W that does not divide B
included, up to float summation order: :func:`reference_losses` computes them in-process at W=1 from
``GlobalBatchSource``.

Every ``checkpoint_every`` steps (and at the end) it reports a Ray Train checkpoint holding the loader state
(``zephon_loader.json``), the model and the optimizer, and it resumes from ``ray.train.get_checkpoint()`` at
whatever W the new worker group has. Rank 0 appends one JSON line per step to ``log_path``: step, W, the global
digest gathered from every rank's slice, the loss, its pid and the time (replayed steps included).

``before_step`` (optional, a picklable ``callable(step, rank)``) runs at the top of each step: the tests inject
failures through it. ``before_digest`` (optional, ``callable(step, rank, slice)``) runs after the optimizer step,
just before the digest gather: the in-place resize test holds a step there until Ray Train tears the group down.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_FILE = "model.pt"
OPTIM_FILE = "optim.pt"
DEFAULTS = {
    "steps": 8,
    "checkpoint_every": 2,
    "lr": 0.05,
    "dim": 32,
    "seed": 0,
    "dataset": "train",
    "before_step": None,
    "before_digest": None,
}


def bigram_model(vocab: int, dim: int, seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab))


def _loss(model, inputs, labels, scale: float):
    """The summed token loss of a microbatch times ``scale``: ``batch.loss_scale("sum")`` (1 / the global batch's
    valid tokens) with the SUM all-reduce below, so every W (uneven slices included) trains the W=1 gradient."""
    import torch

    logits = model(inputs["input"])
    return (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        * scale
    )


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker``; ``config``: ``log_path`` plus any key of ``DEFAULTS``."""
    import ray.train
    import torch
    import torch.distributed as dist

    from zephon_ray.tokenizers import build_tokenizer

    cfg = {**DEFAULTS, **config}
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    shard = ray.train.get_dataset_shard(cfg["dataset"])
    recipe = shard.recipe
    model = bigram_model(int(build_tokenizer(recipe.tokenizer).vocab_size), cfg["dim"], cfg["seed"])
    optim = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    checkpoint = ray.train.get_checkpoint()
    shard.restore(checkpoint)
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            model.load_state_dict(torch.load(Path(d) / MODEL_FILE, weights_only=True))
            optim.load_state_dict(torch.load(Path(d) / OPTIM_FILE, weights_only=True))
    try:
        for batch in shard.iter_steps(until=cfg["steps"]):
            if cfg["before_step"] is not None:
                cfg["before_step"](batch.step, rank)
            optim.zero_grad(set_to_none=True)
            step_loss = torch.zeros(())
            scale = batch.loss_scale("sum")
            for inputs, labels in batch.microbatches:
                loss = _loss(model, inputs, labels, scale)
                loss.backward()
                step_loss += loss.detach()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
            optim.step()
            shard.commit(batch.step)  # the ledger: this step was trained (zephon-ray audit)
            if cfg["before_digest"] is not None:
                cfg["before_digest"](batch.step, rank, batch.slice)
            digest = global_digest(batch.slice)
            if rank == 0:
                with open(cfg["log_path"], "a") as fh:
                    fh.write(
                        json.dumps(
                            {
                                "step": batch.step,
                                "world": world,
                                "digest": digest,
                                "loss": float(step_loss),
                                "pid": os.getpid(),
                                "time": time.time(),
                            }
                        )
                        + "\n"
                    )
            done = batch.step + 1
            if done % cfg["checkpoint_every"] == 0 or done == cfg["steps"]:
                metrics = {"step": batch.step, "loss": float(step_loss), "world": world}
                with tempfile.TemporaryDirectory(prefix="zr-bigram-") as d:
                    shard.save(d)  # every rank: in local mode the Zephon checkpoint is collective
                    if rank == 0:
                        torch.save(model.state_dict(), Path(d) / MODEL_FILE)
                        torch.save(optim.state_dict(), Path(d) / OPTIM_FILE)
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
    finally:
        shard.close()


def reference_losses(recipe_path: str, steps: int, **overrides: Any) -> list[float]:
    """The losses :func:`train_loop` must report, computed in-process at W=1 from ``GlobalBatchSource``."""
    import torch

    from zephon_ray.recipe import Recipe
    from zephon_ray.source import GlobalBatchSource
    from zephon_ray.tokenizers import build_tokenizer

    cfg = {**DEFAULTS, **overrides}
    recipe = Recipe.from_toml(recipe_path)
    model = bigram_model(int(build_tokenizer(recipe.tokenizer).vocab_size), cfg["dim"], cfg["seed"])
    optim = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    losses = []
    with GlobalBatchSource(recipe) as source:
        for step in range(steps):
            optim.zero_grad(set_to_none=True)
            batch = source.batch(step)
            ((inputs, labels),) = batch.slice(0, 1).microbatches(recipe.global_batch_rows)
            loss = _loss(model, inputs, labels, 1.0 / batch.valid_tokens)
            loss.backward()
            optim.step()
            losses.append(float(loss.detach()))
    return losses


def global_digest(piece: Any) -> str | None:
    """Rank 0: the digest of the global batch whose slice ``piece`` (a ``RankSlice``) this rank holds, gathered
    from every rank's slice in rank order over ``torch.distributed``; other ranks: None. A collective: every rank
    calls it for the same step. Equals ``GlobalBatchSource(recipe).batch(step).digest`` when the ranks hold the
    right rows; that is how the examples and tests check the guarantee.

    It never digests part of a batch: a slice of a W-rank group needs that group's W-rank process group, and every
    rank's (step, rank, world) is gathered with the rows and checked. Ray Train destroys the process group in every
    worker (``TorchBackend.on_shutdown``, from another thread) when it tears a group down for a resize or a
    restart, possibly in the middle of a step; the gather then raises a RuntimeError naming the step instead of
    returning the digest of this rank's rows alone (``tests/test_bigram.py``)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from zephon_ray.batch import compute_digest

    step, rank, world = int(piece.step), int(piece.rank), int(piece.world)
    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if (group or 1) != world:
        held = (
            "no torch.distributed process group is up (Ray Train destroys it when it tears the worker group down)"
            if group is None
            else f"the process group has {group} ranks"
        )
        raise RuntimeError(
            f"global_digest: step {step}, rank {rank} holds a slice of a {world}-rank group, but "
            f"{held}; no digest is made from part of the batch"
        )
    local = torch.from_numpy(np.stack([np.asarray(piece.tokens), np.asarray(piece.positions)]).astype(np.int64))
    if world == 1:
        parts = [local]
    else:  # ranks may hold different row counts (W need not divide B): gather (step, rank, world, rows), then
        header = torch.tensor([step, rank, world, local.shape[1]], dtype=torch.int64)  # the rows padded to the most
        headers = [torch.full_like(header, -1) for _ in range(world)]
        dist.all_gather(headers, header)
        got = [tuple(int(v) for v in h[:3]) for h in headers]
        if got != [(step, r, world) for r in range(world)]:
            raise RuntimeError(
                f"global_digest: rank {rank} gathered (step, rank, world) {got} at step {step}; "
                "the ranks are not at the same step of one group"
            )
        counts = [int(h[3]) for h in headers]
        padded = torch.zeros((2, max(counts), local.shape[2]), dtype=torch.int64)
        padded[:, : local.shape[1]] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        parts = [part[:, :n] for part, n in zip(parts, counts)]
    if rank != 0:
        return None
    full = torch.cat(parts, dim=1).numpy()
    return compute_digest(full[0], full[1])
