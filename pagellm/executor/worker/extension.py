"""`collective_rpc` targets: the worker's methods, by name only.

vLLM lets `collective_rpc` ship a pickled callable; here a method is a name, looked up
on the `Worker` object (executor/worker/worker.py, one per tensor-parallel rank), whose class
may be extended with the engine arg `worker_extension_cls="package.module.Class"`
(vLLM's dotted form). That class is imported, never unpickled, and mixed into `Worker`,
so its methods see vLLM's worker attributes (`self.model_runner.model`, `self.device`,
`self.rank`). Only public methods (no leading underscore) of the extension class are
callable. The class must be a plain mixin: no `__init__` or `__new__` of its own (they
would be handed the worker's constructor arguments) and no builtin base.
"""

from __future__ import annotations

import importlib
import inspect

from pagellm.executor.worker.worker import Worker


def worker_class(dotted: str | None) -> type[Worker]:
    """`Worker`, extended by the class `dotted` names (its public methods become the
    ones collective_rpc may call: `rpc_methods`)."""
    if dotted is None:
        return Worker
    module_name, _, class_name = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"worker_extension_cls must be 'package.module.Class', got {dotted!r}")
    try:
        extension = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls {dotted!r} cannot be imported: {e}") from e
    if not inspect.isclass(extension):
        raise ValueError(f"worker_extension_cls {dotted!r} is not a class")
    own = [name for name in ("__init__", "__new__")
           if getattr(extension, name) is not getattr(object, name)]
    if extension.__module__ == "builtins" or own:
        why = f"defines {' and '.join(own)}" if own else "is a builtin type"
        raise ValueError(f"worker_extension_cls {dotted!r} {why}: it must be a plain mixin "
                         "class (methods only; the worker's constructor takes its arguments)")
    methods = frozenset(name for name, member in inspect.getmembers(extension)
                        if callable(member) and not name.startswith("_")
                        and not hasattr(Worker, name))
    clash = [name for name in vars(extension) if hasattr(Worker, name)
             and not name.startswith("__")]
    if clash:
        raise ValueError(f"worker_extension_cls {dotted!r} redefines worker attribute(s) "
                         f"{', '.join(sorted(clash))}")
    try:
        return type(f"{class_name}Worker", (extension, Worker), {"rpc_methods": methods})
    except TypeError as e:  # e.g. a metaclass or layout conflict
        raise ValueError(f"worker_extension_cls {dotted!r} cannot be mixed into the "
                         f"worker: {e}") from None

