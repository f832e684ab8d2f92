"""The engine core: scheduler, KV-cache block manager and the step loop (pure Python;
the model itself runs in `executor`)."""

from typing import Any

__all__ = ["EngineCore"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the scheduler or block manager must not pull in torch (EngineCore
    # brings the executor, and with it torch).
    if name == "EngineCore":
        from pagellm.enginecore.core import EngineCore

        return EngineCore
    raise AttributeError(f"module 'enginecore' has no attribute {name!r}")
