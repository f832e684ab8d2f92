"""A local Ray cluster on loopback for the Ray executor's tests, owned by this process:
`python ray_cluster.py` starts one (Ray's own processes are its children), makes a
placement group of three one-CPU bundles, prints `address pg_id_hex auth_mode` and
serves until its stdin closes, then shuts the cluster down
(tests/executor/test_ray_executor.py). auth_mode is "token" where Ray turned token
authentication on for the new cluster (its default since 2.60; the token is in
~/.ray/auth_token), which its clients must then set too; else "none"."""

from __future__ import annotations

import os
import sys

import ray
from ray.util.placement_group import placement_group


def main() -> None:
    ray.init(num_cpus=5, include_dashboard=False, object_store_memory=100 * 2**20,
             _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False)
    group = placement_group([{"CPU": 1.0}] * 3, strategy="PACK")
    ray.get(group.ready(), timeout=120)
    print(ray.get_runtime_context().gcs_address, group.id.hex(),
          os.environ.get("RAY_AUTH_MODE", "none"), flush=True)
    sys.stdin.read()
    ray.shutdown()


if __name__ == "__main__":
    main()
