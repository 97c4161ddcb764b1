"""Per-step growth of the producers and the node reader: memory-store entries and RSS, without kills or rescales.

    python benchmarks/bench_memory_growth.py [--steps 3000] [--every 500] [--world 4] [--warmup 0]

A service with 2 producers and ``state_dir`` (checkpoint every 8 steps) on ``recipes/tiny.toml``, ``--world``
service-mode loaders in this process with the ledger and a commit per step, a state saved every 100 steps. Prints a
JSON row every ``--every`` steps (each actor's memory-store entries and RSS MB, the coordinator's RSS), then entries
and RSS KB per step from the first row at or after ``--warmup`` to the last (docs/benchmarks.md "Memory over a long
run"; ``bench_soak.py`` is the full soak).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = str(ROOT / "recipes" / "tiny.toml")
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3000)
p.add_argument("--every", type=int, default=500)
p.add_argument("--world", type=int, default=4)
p.add_argument("--warmup", type=int, default=0, help="steps before the growth baseline")
a = p.parse_args()
work = tempfile.mkdtemp(prefix="memgrowth-")
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_soak import start_ray  # noqa: E402  (a private Ray, started again after Ray's fixed start-up timeout)

start_ray(Path(work))
from zephon_ray import DataService  # noqa: E402
from zephon_ray.service.wire import PRODUCER_INFIX, READER_INFIX  # noqa: E402
from zephon_ray.stream.loader import Loader, LoaderConfig  # noqa: E402

NS = "measure"
svc = DataService.start(TINY, name="m", namespace=NS, producers=2, state_dir=work + "/state", checkpoint_every=8)
cfg = LoaderConfig(
    recipe=TINY, mode="service", service_name="m", service_namespace=NS, run_id="r", ledger_dir=work + "/ledger"
)
loaders = [Loader(cfg, rank=r, world=a.world) for r in range(a.world)]
its = [iter(l) for l in loaders]
coordinator = psutil.Process(svc.status()["coordinator"]["pid"])


def handles():
    out = []
    for x in ray.util.list_named_actors(all_namespaces=True):
        if x["namespace"] == NS and (PRODUCER_INFIX in x["name"] or READER_INFIX in x["name"]):
            out.append((x["name"].split(".")[1], ray.get_actor(x["name"], namespace=NS)))
    return sorted(out, key=lambda t: t[0])


rows = []
t0 = time.time()
for s in range(a.steps):
    for it in its:
        next(it)
    for l in loaders:
        l.commit(s)
    if (s + 1) % 100 == 0:
        for l in loaders:
            l.state_dict()
    if (s + 1) % a.every == 0:
        row = {"step": s + 1, "t": round(time.time() - t0)}
        for kind, h in handles():
            m = ray.get(h.memory.remote(), timeout=60)
            row.setdefault(kind, []).append(
                (m["entries"], round(psutil.Process(m["pid"]).memory_info().rss / 2**20, 1))
            )
        row["coordinator_mb"] = round(coordinator.memory_info().rss / 2**20, 1)
        row["driver_mb"] = round(psutil.Process().memory_info().rss / 2**20, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
f, l = next((r for r in rows if r["step"] >= a.warmup), rows[-1]), rows[-1]
n = max(1, l["step"] - f["step"])
for kind in ("producer", "reader"):
    for i, (x, y) in enumerate(zip(f[kind], l[kind])):
        print(
            f"{kind}[{i}] steps {f['step']}..{l['step']}: entries/step {(y[0] - x[0]) / n:.3f}, RSS KB/step {(y[1] - x[1]) * 1024 / n:.2f}"
        )
print(
    f"coordinator steps {f['step']}..{l['step']}: RSS KB/step {(l['coordinator_mb'] - f['coordinator_mb']) * 1024 / n:.2f}"
)
for lo in loaders:
    lo.close()
svc.stop()
ray.shutdown()
