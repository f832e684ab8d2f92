"""`pagellm serve MODEL [--host H] [--port P] [engine flags]`: the server's process.

The engine core starts (or is attached to) before the socket opens, so /health answers
only once requests can be served. SIGTERM or SIGINT stops accepting connections, lets
in-flight requests finish for up to --shutdown-timeout seconds (then aborts them),
stops the engine core and exits 0.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
from typing import Any

from pagellm.frontend.async_llm import AsyncLLM
from pagellm.frontend.server.app import build_app
from pagellm.frontend.server.connections import (
    ConnectionLimits,
    GuardedH11Protocol,
    connection_limit,
)
from pagellm.frontend.server.options import DEV_MODE_ENV, ServerOptions, dev_mode_from_env
from pagellm.frontend.server.template_sandbox import ChatTemplateSandbox
from pagellm.logger import freeze_startup_heap, rate_limit
from pagellm.protocol.engine_args import EngineArgs
from pagellm.transport.curve import CurveClientKeys

logger = logging.getLogger("pagellm")


def run_server(args: EngineArgs, options: ServerOptions, host: str, port: int,
               engine_address: str | None = None, curve_secret_key: str | None = None,
               curve_server_public_key: str | None = None, shutdown_timeout: float = 5.0,
               max_connections: int | None = None,
               max_connections_per_client: int | None = None) -> int:
    import uvicorn

    options = with_env_dev_mode(options)  # a bad value fails before the engine starts
    engine = AsyncLLM.from_engine_args(
        args, engine_address=engine_address,
        curve=CurveClientKeys.from_paths(curve_secret_key, curve_server_public_key))
    if options.chat_template is not None and engine.tokenizer is not None:
        # The tokenizer's own template is what every chat request renders with: setting
        # it here covers them all, as vLLM's --chat-template does.
        engine.tokenizer.chat_template = options.chat_template
    sandbox = None
    if options.trust_request_chat_template and engine.tokenizer is not None:
        sandbox = ChatTemplateSandbox(engine.engine_args.tokenizer or engine.engine_args.model)
    app = build_app(engine, options, sandbox)
    # Without max_connections_per_client, half of the limit in force after the
    # descriptor check (ConnectionLimits.per_client), not half of what was asked.
    limits = ConnectionLimits(
        max_connections=connection_limit(max_connections or ConnectionLimits.max_connections),
        max_connections_per_client=max_connections_per_client)
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            http=functools.partial(GuardedH11Protocol,  # type: ignore[arg-type]
                                                   limits=limits),
                            timeout_graceful_shutdown=max(1, round(shutdown_timeout)))
    # uvicorn configures its loggers in Config(): rate-limit their warnings after that
    # (invalid requests, refused connections and failed accepts come in floods).
    rate_limit("uvicorn.error", "asyncio")
    server = uvicorn.Server(config)
    freeze_startup_heap("server")  # a full collection here stalled every stream ~0.16 s
    # uvicorn re-raises the signal that stopped it once it is done; with these as the
    # handlers it restores, that ends nothing and the process exits 0.
    previous: dict[signal.Signals, Any] = {
        sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        engine.shutdown()
        if sandbox is not None:
            sandbox.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("server stopped")
    return 0


def with_env_dev_mode(options: ServerOptions) -> ServerOptions:
    """VLLM_SERVER_DEV_MODE=1 turns on --enable-dev-endpoints, as it turns on vLLM's
    dev endpoints (TRL's launch line sets it); the flag alone needs no variable, and 0
    does not turn the flag off. A warning says so: these routes drive the whole engine
    (weights, sleep, collective_rpc), and an inherited variable should not open them
    unseen."""
    if dev_mode_from_env(os.environ) and not options.enable_dev_endpoints:
        logger.warning("%s=%s turned on --enable-dev-endpoints: the RL control routes and "
                       "/server_info are served%s", DEV_MODE_ENV,
                       os.environ[DEV_MODE_ENV].strip(),
                       "" if options.api_key is not None else " (no --api-key guards them)")
        return dataclasses.replace(options, enable_dev_endpoints=True)
    return options
