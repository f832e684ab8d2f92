"""Tensor parallelism on Ray (`distributed_executor_backend="ray"`): the workers of one
engine as Ray actors, one per rank, in a placement group of one bundle per rank.

Ray only places, starts and watches the workers. Everything else is the multiprocess
executor's (executor/multiproc.py): the engine core hosts the TCPStore and the call and
reply sockets (TCP on this node's Ray address, since actors may sit on other nodes of
the cluster), each actor runs the same worker loop as a worker process
(`worker_proc._serve`), and the ranks join the same gloo/NCCL group. A dead actor (its
process killed, its node lost) is a `WorkerDied` naming the rank, from a call or from
the watcher thread between calls, which the engine core reports as EngineDeadError.

Placement: inside the placement group this engine was launched in (OpenRLHF and verl
start engines inside theirs; the frontend passes its id to the engine-core process as
PAGELLM_RAY_PLACEMENT_GROUP, and VLLM_RAY_BUNDLE_INDICES / VLLM_RAY_PER_WORKER_GPUS are
honoured as in vLLM), else in one made here ({"GPU": 1} or {"CPU": 1} per rank, PACK)
and removed at shutdown. The cluster: RAY_ADDRESS, else a running local one, else, as
vLLM does, a local instance started here and shut down with the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from pagellm.executor.multiproc import STARTUP_TIMEOUT_S, MultiprocExecutor
from pagellm.protocol.engine_args import RAY_PLACEMENT_GROUP_ENV, EngineArgs

logger = logging.getLogger("pagellm")

BUNDLE_INDICES_ENV = "VLLM_RAY_BUNDLE_INDICES"  # vLLM's: "3,4" = ranks 0 and 1
PER_WORKER_GPUS_ENV = "VLLM_RAY_PER_WORKER_GPUS"  # vLLM's: fractional GPUs per worker
# What the actors' environment carries over from the engine core's (Ray starts them
# from its own raylet, not from this process).
_FORWARDED_PREFIXES = ("PAGELLM_", "VLLM_", "TRITON_", "PYTHONPATH", "OMP_NUM_THREADS",
                       "NCCL_", "GLOO_")
_SHUTDOWN_WAIT_S = 5.0


class RayWorker:
    """One rank as a Ray actor: `serve` runs the worker loop until the engine core
    says shutdown or goes away."""

    def serve(self, cli_args: list[str], rank: int, host: str, port: int) -> None:
        from pagellm.executor.worker_proc import _serve
        from pagellm.logger import configure_logging
        from pagellm.vllm_alias import install_from_environment

        configure_logging()
        install_from_environment()
        args = EngineArgs.from_cli_args(_parse(cli_args))
        # Ray gives each actor its GPU alone (CUDA_VISIBLE_DEVICES): it is cuda:0 here
        # (worker.device_for), and the rank's local index plays no part.
        _serve(args, rank, 0, host, port)

    def pid(self) -> int:
        return os.getpid()


def _parse(cli_args: list[str]) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser.parse_args(cli_args)


class RayExecutor(MultiprocExecutor):
    """`MultiprocExecutor` whose workers are Ray actors (see the module docstring)."""

    def __init__(self, args: EngineArgs, on_failure: Callable[[str], None] | None = None
                 ) -> None:
        self._actors: list[Any] = []
        self._serving: list[Any] = []  # rank -> the ObjectRef of its `serve` call
        self._own_group: Any = None
        self._started_ray = False
        super().__init__(args, on_failure)

    def _rendezvous_host(self, args: EngineArgs) -> tuple[str, bool]:
        ray = _ray()
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            quiet: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
            try:
                ray.init(address=address or "auto", **quiet)
            except ConnectionError as e:
                if address:
                    hint = "" if os.environ.get("RAY_AUTH_MODE") else (
                        " (a cluster with token authentication, Ray's default for local "
                        "clusters since 2.60, takes clients that set RAY_AUTH_MODE=token and "
                        "have its token: ~/.ray/auth_token or RAY_AUTH_TOKEN)")
                    raise RuntimeError(f"distributed_executor_backend='ray': cannot reach "
                                       f"the Ray cluster at RAY_ADDRESS={address!r}: {e}{hint}"
                                       ) from e
                ray.init(**quiet)  # no cluster running: a local one, ours to stop
                self._started_ray = True
        return ray.util.get_node_ip_address(), True

    def _launch(self, args: EngineArgs, host: str, port: int) -> str:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, bundles = self._placement(args)
        gpus = float(os.environ.get(PER_WORKER_GPUS_ENV, "1")) if _on_cuda(args) else 0.0
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)}
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        remote = ray.remote(RayWorker)
        cli_args = args.to_cli_args()
        for rank, bundle in enumerate(bundles):
            actor = remote.options(
                num_cpus=0 if gpus else 1, num_gpus=gpus,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle)).remote()
            self._actors.append(actor)
            self._serving.append(actor.serve.remote(cli_args, rank, host, port))
        return f"Ray actors in bundles {bundles}"

    def _placement(self, args: EngineArgs) -> tuple[Any, list[int]]:
        """The placement group and each rank's bundle index in it."""
        ray = _ray()
        from ray.util.placement_group import PlacementGroup, placement_group

        world = args.tensor_parallel_size
        indices = os.environ.get(BUNDLE_INDICES_ENV)
        bundles = list(range(world))
        if indices:
            bundles = [int(i) for i in indices.split(",")]
            if len(bundles) != world or len(set(bundles)) != world:
                raise ValueError(f"{BUNDLE_INDICES_ENV}={indices!r} must name "
                                 f"{world} distinct bundles, one per tensor-parallel rank")
        existing = os.environ.get(RAY_PLACEMENT_GROUP_ENV)
        if existing:
            from ray._raylet import PlacementGroupID

            group = PlacementGroup(PlacementGroupID(bytes.fromhex(existing)))
        else:
            group = ray.util.get_current_placement_group()
        if group is None:
            unit = {"GPU": 1.0} if _on_cuda(args) else {"CPU": 1.0}
            group = self._own_group = placement_group([dict(unit)] * world, strategy="PACK")
        try:
            ray.get(group.ready(), timeout=STARTUP_TIMEOUT_S)
        except Exception as e:
            raise RuntimeError(f"distributed_executor_backend='ray': the placement group "
                               f"for {world} worker(s) was not ready within "
                               f"{STARTUP_TIMEOUT_S:.0f} s (cluster resources: "
                               f"{ray.cluster_resources()}): {e}") from e
        if max(bundles) >= group.bundle_count:
            raise ValueError(f"bundle {max(bundles)} is outside the placement group's "
                             f"{group.bundle_count} bundles")
        return group, bundles

    # -- health ------------------------------------------------------------------------

    def _find_failure(self) -> str | None:
        if not self._serving:
            return None
        ray = _ray()
        done, _ = ray.wait(self._serving, num_returns=len(self._serving), timeout=0)
        for ref in done:
            rank = self._serving.index(ref)
            try:
                ray.get(ref, timeout=0)
                why = "returned before shutdown"
            except Exception as e:  # RayActorError: the actor's process or node died
                why = f"died: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return f"tensor-parallel rank {rank} (Ray actor) {why}"
        return None

    # -- shutdown ----------------------------------------------------------------------

    def _stop_workers(self) -> None:
        super()._stop_workers()
        if not self._actors:
            self._release_ray()
            return
        ray = _ray()
        with contextlib.suppress(Exception):  # a clean shutdown returns every serve
            ray.wait(self._serving, num_returns=len(self._serving), timeout=_SHUTDOWN_WAIT_S)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors, self._serving = [], []
        self._release_ray()

    def _release_ray(self) -> None:
        ray = _ray()
        if self._own_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._own_group)
            self._own_group = None
        if self._started_ray:
            self._started_ray = False
            ray.shutdown()


def _on_cuda(args: EngineArgs) -> bool:
    if args.device == "cpu":
        return False
    if args.device.startswith("cuda"):
        return True
    return float(_ray().cluster_resources().get("GPU", 0)) > 0


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed_executor_backend='ray' needs Ray: "
                          "pip install 'pagellm[ray]'") from e
    return ray
