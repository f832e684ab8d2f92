"""`collective_rpc` targets: the worker's methods, by name only.

vLLM lets `collective_rpc` ship a pickled callable; here a method is a name, looked up
on the `Worker` object, whose class may be extended with the engine arg
`worker_extension_cls="package.module.Class"` (vLLM's dotted form). That class is
imported, never unpickled, and mixed into `Worker`, so its methods see vLLM's worker
attributes (`self.model_runner.model`, `self.device`, `self.rank`). Only public methods
(no leading underscore) of the extension class are callable.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagellm.executor.executor import Executor


class Worker:
    """What an extension method sees as `self`. One worker today (no tensor parallel),
    so rank 0 of a world of 1."""

    rank = 0
    local_rank = 0
    world_size = 1

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.model_runner = executor.runner
        self.device = executor.device


def load_extension(dotted: str | None, executor: Executor) -> tuple[Worker, frozenset[str]]:
    """The worker (extended when `dotted` names a class) and the method names that
    collective_rpc may call on it."""
    if dotted is None:
        return Worker(executor), frozenset()
    module_name, _, class_name = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"worker_extension_cls must be 'package.module.Class', got {dotted!r}")
    try:
        extension = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls {dotted!r} cannot be imported: {e}") from e
    if not inspect.isclass(extension):
        raise ValueError(f"worker_extension_cls {dotted!r} is not a class")
    methods = frozenset(name for name, member in inspect.getmembers(extension)
                        if callable(member) and not name.startswith("_")
                        and not hasattr(Worker, name))
    clash = [name for name in vars(extension) if hasattr(Worker, name)
             and not name.startswith("__")]
    if clash:
        raise ValueError(f"worker_extension_cls {dotted!r} redefines worker attribute(s) "
                         f"{', '.join(sorted(clash))}")
    worker_class = type(f"{class_name}Worker", (extension, Worker), {})
    return worker_class(executor), methods


def call(worker: Worker, methods: frozenset[str], method: str, args: list[Any],
         kwargs: dict[str, Any]) -> Any:
    """Run one collective_rpc method; errors name the method."""
    if method not in methods:
        known = ", ".join(sorted(methods)) or "none: set worker_extension_cls"
        raise ValueError(f"collective_rpc: unknown method {method!r} (callable: {known})")
    return getattr(worker, method)(*args, **kwargs)
