"""Logging for entry points: INFO lines such as the KV-cache size at start-up."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("pagellm")


def configure_logging() -> None:
    """INFO to stderr for the `pagellm` logger unless the application configured it
    already; PAGELLM_LOG_LEVEL=WARNING quiets it."""
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGELLM_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
