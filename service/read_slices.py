"""Read slices from a running data service and print their digests (a job next to the one that serves).

    python service/read_slices.py --name run7 --namespace zr --steps 0:8 --world 4

prints, per step, ``step <s> <global digest>`` and, per rank, ``slice <s> <rank>/<world> <sha256 of the rows>``
(the global-batch digest formula applied to the rank's rows), then releases its cursor.
"""

from __future__ import annotations

import argparse
import sys

from zephon_ray import DataService, compute_digest
from zephon_ray.cli.data import parse_steps
from zephon_ray.service.client.session import ray_session


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", default="zephon-ray")
    p.add_argument("--namespace", default="zephon-ray")
    p.add_argument("--address", default=None)
    p.add_argument("--steps", default="0:4")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--consumer", default="read-slices")
    args = p.parse_args(argv)
    steps = parse_steps(args.steps)
    with ray_session(args.address, private_if_none=False):
        svc = DataService.connect(args.name, namespace=args.namespace, consumer=args.consumer, timeout_s=120)
        for step in steps:
            print(f"step {step} {svc.batch(step, track=True).digest}", flush=True)
            for rank in range(args.world):
                part = svc.slice(step, rank, args.world, track=True)
                print(f"slice {step} {rank}/{args.world} {compute_digest(part.tokens, part.positions)}", flush=True)
        svc.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
