"""vLLM's `vllm.utils`: `random_uuid` (OpenRLHF's request ids)."""

from __future__ import annotations

import uuid


def random_uuid() -> str:
    """A fresh random id, 32 hex digits (vLLM's)."""
    return uuid.uuid4().hex


__all__ = ["random_uuid"]
