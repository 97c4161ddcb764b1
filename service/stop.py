"""Stop a running data service from a job: ``python service/stop.py --name run7 --namespace zr``."""

import sys

from zephon_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["stop", *sys.argv[1:]]))
