"""Elastic resume under Ray Train: identical global batches across any change of worker count.

    python examples/elastic_resume.py                 # service mode (the zephon-ray DataService)
    python examples/elastic_resume.py --mode local    # each worker runs Zephon for its own lanes (torch:// store)
    python examples/elastic_resume.py --recipe recipes/demo.toml   # what `make demo` runs (stdlib corpus, BPE)
    python examples/elastic_resume.py --trainer torchtitan        # TorchTitan's Trainer, llama3 debug model, CPU

It starts its own private local Ray cluster and, all under Ray Train's TorchTrainer, runs:

1. a reference run at a fixed W (2 workers, all steps);
2. a run at W1=4 that checkpoints at step k (through ray.train.report);
3. a resume at W2=5 from ray.train.get_checkpoint(), then a resume at W3=3 (local mode: 2, then 3).

W2=5 divides neither B=24 (recipes/elastic.toml) nor B=12 (recipes/demo.toml): ranks hold floor(B/W) or ceil(B/W)
rows, and every step is still the same global batch with the same loss.

The default trainer is the tiny bigram LM of examples/bigram.py, which reads its batches through Ray Train's own
data API (``ray.train.get_dataset_shard`` over a ``ZephonDataset``). ``--trainer torchtitan`` runs TorchTitan's
real Trainer (llama3 debug model, 2 layers, CPU shims; examples.torchtitan_ray_train) instead, with TorchTitan's
own DCP checkpoints shared by the fits of a run.

Local mode needs W dividing the recipe's 12 lanes (each worker runs Zephon for whole lanes). Every step's global digest
is gathered from the ranks' slices; the script prints digests and losses side by side, checks them against the
in-process reference (what `zephon-ray digest` prints), and exits non-zero on any mismatch. With the bigram
trainer every rank writes its ledger segment at each checkpoint, and the demo ends with `zephon-ray audit`'s verdict
on the elastic run's last checkpoint: every step in [0, steps) trained exactly once, on the recipe's rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_RECIPE = str(ROOT / "recipes" / "elastic.toml")
LOSS_TOLERANCE = 1e-5  # measured: at most 9.5e-07 for either trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help="recipe TOML; every W used must be at most its B rows (local mode: divide its lanes)",
    )
    parser.add_argument("--mode", choices=("service", "local"), default="service")
    parser.add_argument("--trainer", choices=("bigram", "torchtitan"), default="bigram")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="the W1 run trains and checkpoints up to step k")
    parser.add_argument("--k2", type=int, default=6, help="the W2 run trains up to this step")
    parser.add_argument("--worlds", default=None, help="W1,W2,W3 (default 4,5,3; local mode 4,2,3)")
    parser.add_argument("--reference-world", type=int, default=2)
    parser.add_argument(
        "--aggregate-dir",
        default=None,
        help="local mode: aggregate Zephon checkpoints in this directory instead of torch://",
    )
    args = parser.parse_args()
    w1, w2, w3 = (int(x) for x in (args.worlds or ("4,2,3" if args.mode == "local" else "4,5,3")).split(","))
    RECIPE = str(Path(args.recipe).resolve())
    if not 0 < args.k < args.k2 < args.steps:
        parser.error("need 0 < k < k2 < steps")

    import ray

    from examples.torchtitan_ray_train import read_log
    from zephon_ray import GlobalBatchSource, Recipe

    work = Path(tempfile.mkdtemp(prefix="zephon-ray-demo-"))
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=str(work / "ray"),
        log_to_driver=False,
        namespace="zephon-ray-demo",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}},
    )
    service = None
    t0 = time.time()
    try:
        loader: dict = {"mode": args.mode}
        if args.mode == "service":
            from zephon_ray import DataService

            service = DataService.start(
                RECIPE,
                name="demo",
                namespace="zephon-ray-demo",
                producers=2,
                window=8,
                state_dir=str(work / "service"),
                checkpoint_every=4,
                aggregate_store="torch://",
                run_id="demo",
            )
            loader.update(service_name="demo", service_namespace="zephon-ray-demo")
        elif args.aggregate_dir or os.environ.get("ZEPHON_RAY_AGGREGATE_DIR"):
            loader["aggregate_dir"] = args.aggregate_dir or os.environ["ZEPHON_RAY_AGGREGATE_DIR"]
        else:
            loader["aggregate_store"] = "torch://"

        def fit_bigram(name: str, world: int, until: int, log: Path):
            from ray.train import RunConfig, ScalingConfig
            from ray.train.torch import TorchTrainer

            from examples.bigram import train_loop
            from zephon_ray import ray_train

            dataset = (
                ray_train.ZephonDataset(service)
                if service is not None
                else ray_train.ZephonDataset(RECIPE, aggregate_dir=loader.get("aggregate_dir"))
            )
            return TorchTrainer(
                train_loop,
                train_loop_config={"log_path": str(log), "steps": until, "checkpoint_every": 2},
                datasets={"train": dataset},
                dataset_config=ray_train.ZephonDataConfig(
                    run_id=f"demo-{name}", ledger_dir=str(work / f"ledger-{name}")
                ),
                scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 0.25}),
                run_config=RunConfig(name=name, storage_path=str(work / "ray-results")),
            ).fit()

        def fit_torchtitan(name: str, world: int, until: int, log: Path):
            from examples.torchtitan_ray_train import TitanRun, fit

            run = TitanRun(
                recipe=RECIPE,
                run_id=f"demo-{name}",
                dump_folder=str(work / f"dump-{name}"),
                log_path=str(log),
                steps=until,
                total_steps=args.steps,
                checkpoint_every=2,
                **loader,
            )
            return fit(run, workers=world, name=name, storage_path=str(work / "ray-results"))

        def phase(label: str, name: str, world: int, until: int, log: Path) -> Any:
            t = time.time()
            result = (fit_torchtitan if args.trainer == "torchtitan" else fit_bigram)(name, world, until, log)
            if result.error is not None:
                raise RuntimeError(f"{label} failed: {result.error}")
            print(f"  {label:<44} W={world}  until step {until:<3} {time.time() - t:5.1f} s", flush=True)
            return result

        print(
            f"zephon-ray elastic resume demo: trainer {args.trainer}, recipe {RECIPE}, mode {args.mode}, "
            f"{args.steps} steps"
        )
        ref_log, el_log = work / "reference.jsonl", work / "elastic.jsonl"
        phase("reference run (fixed W)", "reference", args.reference_world, args.steps, ref_log)
        phase(f"run at W1, checkpoint at step k={args.k}", "elastic", w1, args.k, el_log)
        phase("resume at W2 (ray.train.get_checkpoint)", "elastic", w2, args.k2, el_log)
        last = phase("resume at W3 (ray.train.get_checkpoint)", "elastic", w3, args.steps, el_log)

        with GlobalBatchSource(Recipe.from_toml(RECIPE)) as source:
            expected = [source.batch(s).digest for s in range(args.steps)]
        tolerance = LOSS_TOLERANCE
        ref = {r["step"]: r for r in read_log(str(ref_log))}
        elastic = {r["step"]: r for r in read_log(str(el_log))}

        print()
        print(
            f"{'step':>4}  {'W':>2} {'reference digest':<18} {'W':>2} {'elastic digest':<18} "
            f"{'loss (ref)':>11} {'loss (elastic)':>14}  same"
        )
        ok = sorted(ref) == sorted(elastic) == list(range(args.steps))
        for s in range(args.steps):
            a, b = ref.get(s), elastic.get(s)
            if a is None or b is None:
                print(f"{s:>4}  missing a record")
                ok = False
                continue
            same = a["digest"] == b["digest"] == expected[s] and abs(a["loss"] - b["loss"]) <= tolerance
            ok &= same
            print(
                f"{s:>4}  {a['world']:>2} {a['digest'][:16]:<18} {b['world']:>2} {b['digest'][:16]:<18} "
                f"{a['loss']:>11.6f} {b['loss']:>14.6f}  {'yes' if same else 'NO'}"
            )
        print()
        print(
            f"digests also equal `zephon-ray digest {Path(RECIPE).relative_to(ROOT)} --steps 0:{args.steps}`: "
            f"{'yes' if [elastic.get(s, {}).get('digest') for s in range(args.steps)] == expected else 'NO'}"
        )
        worst = max(
            (abs(ref[s]["loss"] - elastic[s]["loss"]) for s in range(args.steps) if s in ref and s in elastic),
            default=0.0,
        )
        print(
            f"largest loss difference: {worst:.1e} (tolerance {tolerance:.0e}: gradient sums are reduced in a "
            "different order at each W)"
        )
        print(f"identical global batches: {'YES' if ok else 'NO'}   ({time.time() - t0:.0f} s)")
        if args.trainer == "bigram":  # the ledger of the elastic run's last checkpoint, back to step 0
            from zephon_ray.cli import main as cli

            ok &= (
                cli(["audit", last.checkpoint.path, "--ledger", str(work / "ledger-elastic"), "--recipe", RECIPE]) == 0
            )
        return 0 if ok else 1
    finally:
        if service is not None:
            service.stop()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
