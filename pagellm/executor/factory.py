"""`create_executor`: the engine core's one choice of executor. Apart from the classes
so that `executor.py` (the base) never imports `multiproc.py` (a subclass)."""

from __future__ import annotations

from collections.abc import Callable

from pagellm.executor.executor import Executor, UniProcExecutor
from pagellm.executor.multiproc import MultiprocExecutor
from pagellm.protocol.engine_args import EngineArgs


def create_executor(args: EngineArgs, on_failure: Callable[[str], None] | None = None
                    ) -> Executor:
    """The executor for `args`: Ray actors for backend "ray"; in this process for one
    rank; else one process per rank (`on_failure` hears, from a watcher thread, when a
    worker dies between calls)."""
    if args.distributed_executor_backend == "ray":
        from pagellm.executor.ray_executor import RayExecutor

        return RayExecutor(args, on_failure)
    if args.tensor_parallel_size == 1:
        return UniProcExecutor(args)
    return MultiprocExecutor(args, on_failure)
