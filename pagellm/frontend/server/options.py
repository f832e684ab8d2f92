"""The HTTP server's own options (no FastAPI here: the CLI builds them before the
`serve` extra is known to be installed)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ServerOptions:
    """What `pagellm serve` decides about the HTTP layer."""

    served_model_name: str
    api_key: str | None = None  # guards every route but /health, /metrics, /version
    max_body_bytes: int = MAX_BODY_BYTES
    trust_request_chat_template: bool = False  # requests may bring a chat template
    enable_dev_endpoints: bool = False  # the RL control routes (dev_routes.py)
    chat_template: str | None = None  # replaces the tokenizer's own (--chat-template)
