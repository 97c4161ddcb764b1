"""Keys in the TCPStore a service hosts for its producers' collective checkpoints, as the steps go by.

    python benchmarks/service_store_keys.py [STEPS] [EVERY]      # default 3000 500

A service of ``recipes/tiny.toml`` with 2 producers (a checkpoint every 8 steps, ``aggregate_store="torch://"``: the
coordinator hosts the store) on a private local Ray; this process reads every step and prints the store's key count
every EVERY steps. Flat is right: Zephon deletes its rounds' keys, and each producer deletes its lane exchange
value of a checkpoint at the next one (docs/limits.md, "Memory per step").
"""

import sys
import tempfile
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_soak import start_ray  # noqa: E402  (a private Ray, started again after Ray's fixed start-up timeout)

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
every = int(sys.argv[2]) if len(sys.argv) > 2 else 500
start_ray(Path(tempfile.mkdtemp(prefix="store-keys-")))

import ray  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

from zephon_ray import DataService  # noqa: E402

svc = DataService.start(
    str(ROOT / "recipes" / "tiny.toml"),
    name="keys",
    namespace="store-keys",
    producers=2,
    checkpoint_every=8,
    aggregate_store="torch://",
    run_id="keys",
)
try:
    host, port = svc.status()["aggregate"]["store"][len("torch://") :].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    for step in range(steps + 1):
        svc.batch(step, track=True)
        if step % every == 0:
            print(f"step {step:>6}  keys {store.num_keys()}", flush=True)
finally:
    svc.stop()
    ray.shutdown()
