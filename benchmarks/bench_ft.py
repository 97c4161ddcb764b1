"""torchft benchmark: the per-step cost of FtSlices' membership check, against the same reads without it.

    python benchmarks/bench_ft.py [--recipe recipes/elastic.toml] [--steps 64] [--rounds 4] [--groups 2]

A private Ray materialises ``--steps`` steps of the recipe once; then a torchft Lighthouse and ``--groups`` replica
groups (torchft Managers over ProcessGroupGloo, one thread each, in this process) run ``--steps`` steps per round:
``start_quorum()``, read, one all-reduce of a scalar (lock-step, as gradients would), ``should_commit()``. Two sides alternate in rounds (order flipped every round) and do the
same work, each group reading its slice of every step from the same directory and cutting it into one microbatch:

* **ft**: ``FtSlices.next()`` (reads the quorum from the Manager, checks the membership, then the prefetched slice);
* **plain**: the same prefetch source at the same (rank, world), ``DatasetSlices.next()``, with no Manager reads.

Prints, per side, the median over rounds of the p50 time of the data call per step, the membership check alone
(``FtSlices.check_seconds``) and, for context, torchft's own ``start_quorum`` + all-reduce + ``should_commit`` per step.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run_round(args, directory: str, side: str) -> dict[str, float]:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    from zephon_ray.recipe import Recipe
    from zephon_ray.stream.dataset import DatasetSlices
    from zephon_ray.stream.ft import FtSlices
    from zephon_ray.stream.loader import LoaderConfig
    from zephon_ray.stream.slice_stream import stream_state

    n = args.groups
    recipe = Recipe.from_toml(args.recipe)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n, join_timeout_ms=2000, heartbeat_timeout_ms=5000)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(n)]
    managers = [
        Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
            min_replica_size=1,
            load_state_dict=lambda s: None,
            state_dict=lambda: {},
            replica_id=f"bench_{g}",
            lighthouse_addr=lighthouse.address(),
            store_addr="127.0.0.1",
            store_port=stores[g].port,
            rank=0,
            world_size=1,
            use_async_quorum=False,
            init_sync=False,
        )
        for g in range(n)
    ]
    config = LoaderConfig(recipe=args.recipe, mode="dataset", dataset_dir=directory, prefetch=4)

    def group(g: int) -> tuple[list[float], list[float], list[float]]:
        m = managers[g]
        data, torchft, checks = [], [], []
        ft = FtSlices(config, manager=m, recipe=recipe) if side == "ft" else None
        plain = DatasetSlices(recipe, directory, rank=g, world=n, depth=4) if side == "plain" else None
        if plain is not None:
            plain.reset(stream_state(0))
        try:
            while m.current_step() < args.steps:
                t = time.perf_counter()
                m.start_quorum()
                q = time.perf_counter() - t
                t = time.perf_counter()
                if ft is not None:
                    batch = ft.next()
                    assert batch.slice.rank == g and batch.slice.world == n
                else:
                    piece = plain.next(600)
                    list(piece.microbatches(piece.num_rows))
                data.append(time.perf_counter() - t)
                t = time.perf_counter()
                m.allreduce(torch.ones(1)).wait()  # the groups' one collective per step keeps them in lock-step
                assert m.should_commit()
                torchft.append(q + time.perf_counter() - t)
            if ft is not None:
                checks = ft.check_seconds
        finally:
            if ft is not None:
                ft.close()
            if plain is not None:
                plain.close()
        return data[1:], torchft[1:], checks[1:]  # step 0: cold start

    try:
        with ThreadPoolExecutor(n) as pool:
            out = list(pool.map(group, range(n)))
    finally:
        for m in managers:
            m.shutdown(wait=False)
        lighthouse.shutdown()
    return {
        "data_us": 1e6 * p50([x for d, _, _ in out for x in d]),
        "torchft_us": 1e6 * p50([x for _, q, _ in out for x in q]),
        "check_us": 1e6 * p50([x for _, _, c in out for x in c]) if side == "ft" else float("nan"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "elastic.toml"))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    args = parser.parse_args()

    import ray

    from zephon_ray.jobs.materialize import materialize
    from zephon_ray.recipe import Recipe

    work = Path(tempfile.mkdtemp(prefix="zr-bench-ft-"))
    try:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(work / "ray"))
        materialize(
            Recipe.from_toml(args.recipe),
            work / "rows",
            range(0, args.steps),
            producers=1,
            segment_steps=16,
            progress=False,
        )
        ray.shutdown()
        results: dict[str, list[dict[str, float]]] = {"ft": [], "plain": []}
        for r in range(args.rounds):
            for side in ("ft", "plain") if r % 2 == 0 else ("plain", "ft"):
                results[side].append(run_round(args, str(work / "rows"), side))
            print(
                f"round {r}: ft data call p50 {results['ft'][-1]['data_us']:.0f} us (check "
                f"{results['ft'][-1]['check_us']:.1f} us), plain {results['plain'][-1]['data_us']:.0f} us",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in results[side])

    print(
        f"recipe {args.recipe}: {args.groups} replica groups, {args.steps} steps, {args.rounds} rounds alternating "
        "(median over rounds of per-step p50)"
    )
    print(f"  data call per step, FtSlices.next():          {med('ft', 'data_us'):8.1f} us")
    print(f"  data call per step, DatasetSlices.next():     {med('plain', 'data_us'):8.1f} us")
    print(f"  membership check alone (FtSlices):            {med('ft', 'check_us'):8.1f} us")
    print(f"  torchft quorum + all-reduce + commit per step: {med('plain', 'torchft_us'):8.1f} us (context)")
    print(f"  ratio ft/plain of the data call: {med('ft', 'data_us') / med('plain', 'data_us'):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
