"""Start the data service from a ``ray job submit`` job (or any driver on the cluster).

    ray job submit --address http://127.0.0.1:8265 --entrypoint-num-cpus 0 --working-dir . -- \\
        python service/start.py recipes/tiny.toml --name run7 --namespace zr --producers 2 \\
        --state-dir /shared/zr/run7          # run_id: the name; aggregation: a TCPStore the service hosts

The service is a detached actor: it keeps running after this job exits (add ``--block`` to keep the job alive
until ``zephon-ray stop``). All flags are those of ``zephon-ray serve``.
"""

import sys

from zephon_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
