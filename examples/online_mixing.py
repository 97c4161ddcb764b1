"""Online data mixing, decided while the run trains and replayed bit for bit: an example, not a framework.

    python examples/online_mixing.py [--recipe recipes/mixture.toml] [--steps 24] [--every 6] [--lag 4]

1. **The policy run** (local mode, W = 1): a bigram model trains on the recipe's mixture. The loader hands each
   microbatch's per-token source ids (``LoaderConfig(source_ids=True)``); every ``--every`` steps the loop turns the
   per-source mean losses of those steps (one ``scatter_add``) into new weights with an exponentiated-gradient step
   (sources the model finds harder get more weight) and adds them as a mixture phase ``--lag`` steps ahead
   (``Loader.add_phase``: past what the loader has already made). Its loader state records every phase.
2. **The replay**: the recipe file unchanged plus the schedule the run recorded (``run_recipe``), read in-process
   from step 0 with no policy at all: ``identical global batches: YES``.
3. **The resume**: from the state the run saved halfway, at W = 3 in service mode (a private local Ray and a data
   service of the run's schedule): the rest of the run's global batches again, ``YES``.

Exit code 1 if either check fails. ``tests/test_online_mixing.py`` runs it at a small size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def policy_run(recipe_path: str, steps: int, every: int, lag: int, eta: float) -> tuple[list[str], dict, dict]:
    """Train with the policy: the global digest of every step, the state saved halfway and the final state."""
    import torch

    from examples.bigram import bigram_model
    from zephon_ray import Loader, LoaderConfig
    from zephon_ray.tokenizers import build_tokenizer

    config = LoaderConfig(recipe=recipe_path, mode="local", run_id="online-mixing", source_ids=True)
    loader = Loader(config, rank=0, world=1, local_batch_size=8)
    recipe = loader.recipe
    names = recipe.source_names
    model = bigram_model(int(build_tokenizer(recipe.tokenizer).vocab_size), 32, 0)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    weights = list(recipe.segment_weights(0))
    loss_sum, token_count = torch.zeros(len(names)), torch.zeros(len(names))
    digests, halfway = [], None
    with loader:
        for batch in loader:
            optim.zero_grad(set_to_none=True)
            for inputs, labels in batch.microbatches:
                logits = model(inputs["input"])
                token_loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
                )
                (token_loss.sum() / batch.global_valid_tokens).backward()
                ids, loss = inputs["source_ids"].reshape(-1), token_loss.detach()
                keep = (ids >= 0) & (labels.reshape(-1) != -100)
                loss_sum.scatter_add_(0, ids[keep], loss[keep])  # per-domain losses: one scatter_add
                token_count.scatter_add_(0, ids[keep], torch.ones_like(loss[keep]))
            optim.step()
            digests.append(global_batch_digest(batch))
            step = batch.step
            if (step + 1) % every == 0 and step + 1 < steps:
                means = (loss_sum / token_count.clamp(min=1)).tolist()
                weights = [w * math.exp(eta * m) for w, m in zip(weights, means)]  # exponentiated gradient
                weights = [w / sum(weights) for w in weights]
                start = step + 1 + lag
                loader.add_phase(f"policy-{step + 1}", start, dict(zip(names, (round(w, 4) for w in weights))))
                print(
                    f"step {step}: per-source mean loss "
                    + ", ".join(f"{n} {m:.3f}" for n, m in zip(names, means))
                    + f" -> phase from step {start}: "
                    + ", ".join(f"{n} {w:.4f}" for n, w in zip(names, weights))
                )
                loss_sum.zero_()
                token_count.zero_()
            if step + 1 == steps // 2:
                halfway = json.loads(json.dumps(loader.state_dict()))
            if step + 1 == steps:
                break
        final = json.loads(json.dumps(loader.state_dict()))
    return digests, halfway, final


def global_batch_digest(batch) -> str:
    """The digest of the global batch a W = 1 reader holds (its slice is all of it)."""
    from zephon_ray import compute_digest

    return compute_digest(batch.slice.tokens, batch.slice.positions)


def replay(recipe_path: str, final: dict, steps: int) -> list[str]:
    """The run's schedule from its state, read in-process from step 0, no policy."""
    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.formats.loader_state import run_recipe

    recipe = run_recipe(final, Recipe.from_toml(recipe_path))
    with GlobalBatchSource(recipe) as source:
        return [source.batch(s).digest for s in range(steps)]


def resume(recipe_path: str, halfway: dict, final: dict, steps: int, world: int) -> tuple[list[str], int]:
    """From the halfway state, at ``world`` readers in service mode, under the run's recorded schedule: the global
    digests of the steps it read, and the first of them."""
    import numpy as np

    from zephon_ray import DataService, Loader, LoaderConfig, Recipe, compute_digest
    from zephon_ray.formats.loader_state import run_recipe

    recipe = run_recipe(final, Recipe.from_toml(recipe_path))  # every phase the run decided, the later ones too
    first = halfway["next_step"]
    with tempfile.TemporaryDirectory(prefix="zr-online-mixing-") as work:
        service = DataService.start(
            recipe,
            name="online-mixing",
            namespace="zr-online-mixing",
            state_dir=f"{work}/state",
            ray_init={"address": "local", "num_cpus": 4, "include_dashboard": False, "log_to_driver": False},
        )
        try:
            config = LoaderConfig(
                recipe=recipe_path,
                mode="service",
                run_id="online-mixing",
                service_name="online-mixing",
                service_namespace="zr-online-mixing",
            )
            slices: list[list] = [[] for _ in range(world)]
            errors: list[BaseException] = []

            def read(rank: int) -> None:
                try:
                    with Loader(config, rank=rank, world=world, recipe=recipe) as loader:
                        loader.load_state_dict(json.loads(json.dumps(halfway)))
                        for batch in loader:
                            slices[rank].append(batch.slice)
                            if batch.step + 1 == steps:
                                break
                except BaseException as exc:  # noqa: BLE001 - reported by the caller
                    errors.append(exc)

            threads = [threading.Thread(target=read, args=(r,)) for r in range(world)]
            [t.start() for t in threads]
            [t.join(600) for t in threads]
            if errors:
                raise errors[0]
            return [
                compute_digest(np.concatenate([p.tokens for p in parts]), np.concatenate([p.positions for p in parts]))
                for parts in zip(*slices)
            ], first
        finally:
            service.stop()
            import ray

            ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "mixture.toml"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6, help="steps between two decisions of the policy")
    parser.add_argument("--lag", type=int, default=4, help="a decision takes effect this many steps later")
    parser.add_argument("--eta", type=float, default=1.0, help="the exponentiated-gradient step size")
    parser.add_argument("--world", type=int, default=3, help="readers of the resume")
    args = parser.parse_args()

    digests, halfway, final = policy_run(args.recipe, args.steps, args.every, args.lag, args.eta)
    from zephon_ray.formats.loader_state import run_schedule

    print("the schedule the run built:")
    for phase in run_schedule(final)["phases"]:
        print(f"  from step {phase['start_step']}: " + ", ".join(f"{k} {v:g}" for k, v in phase["weights"].items()))
    same = replay(args.recipe, final, args.steps) == digests
    print(
        f"replay from step 0 with the recorded schedule, no policy: identical global batches: {'YES' if same else 'NO'}"
    )
    resumed, first = resume(args.recipe, halfway, final, args.steps, args.world)
    again = resumed == digests[first:]
    print(f"resume at step {first}, W={args.world}, service mode: identical global batches: {'YES' if again else 'NO'}")
    return 0 if same and again else 1


if __name__ == "__main__":
    sys.exit(main())
