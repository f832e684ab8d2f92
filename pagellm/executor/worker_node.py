"""A node of a multi-node tensor-parallel run that runs only workers
(`python -m pagellm.enginecore --headless --nnodes N --node-rank R`, R > 0): its ranks
join the engine core of node 0 through --master-addr and --master-port. Not to be
confused with `pagellm serve --headless` (frontend/engine_client/dp_node.py), which
runs whole data-parallel engine cores."""

from __future__ import annotations

import logging
import os
import signal
import threading

from pagellm.executor.multiproc import SHUTDOWN_WAIT_S, spawn_worker, stop_processes
from pagellm.protocol.engine_args import EngineArgs

logger = logging.getLogger("pagellm")


def run_worker_node(args: EngineArgs) -> int:
    """`python -m pagellm.enginecore --headless` on node `node_rank` > 0: start this
    node's workers, which join the engine core of node 0 through --master-addr and
    --master-port, and wait for them; SIGTERM stops them."""
    if args.nnodes < 2 or args.node_rank == 0:
        raise ValueError("--headless runs the workers of nodes 1.. of a multi-node run: "
                         "it needs --nnodes > 1 and --node-rank > 0")
    per_node = args.tensor_parallel_size // args.nnodes
    procs, lifelines = [], []
    for local_rank in range(per_node):
        read, write = os.pipe()
        procs.append(spawn_worker(args, args.node_rank * per_node + local_rank, local_rank,
                                  args.master_addr, args.master_port, per_node, read))
        os.close(read)
        lifelines.append(write)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("headless node %d: tensor-parallel ranks %d..%d started", args.node_rank,
                args.node_rank * per_node, (args.node_rank + 1) * per_node - 1)
    while not stop.wait(0.2) and all(p.poll() is None for p in procs):
        pass
    for fd in lifelines:
        os.close(fd)
    stop_processes(procs, SHUTDOWN_WAIT_S)
    codes = [p.returncode for p in procs]
    logger.info("headless node %d: workers exited with %s", args.node_rank, codes)
    return 0 if stop.is_set() or all(c == 0 for c in codes) else 1

