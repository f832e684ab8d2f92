"""`pagellm serve MODEL [--host H] [--port P] [engine flags]`: the server's process.

The engine core starts (or is attached to) before the socket opens, so /health answers
only once requests can be served. SIGTERM or SIGINT stops accepting connections, lets
in-flight requests finish for up to --shutdown-timeout seconds (then aborts them),
stops the engine core and exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Any

from frontend.async_llm import AsyncLLM
from frontend.llm import FRONTEND_OPTIONS
from frontend.server.app import build_app
from protocol.engine_args import EngineArgs

logger = logging.getLogger("pagellm")


def run_server(args: EngineArgs, host: str, port: int, served_model_name: str | None,
               api_key: str | None, engine_address: str | None = None,
               curve_secret_key: str | None = None,
               curve_server_public_key: str | None = None,
               shutdown_timeout: float = 30.0) -> int:
    import uvicorn

    options = {k: v for k, v in dataclasses.asdict(args).items() if k != "model"}
    if engine_address is not None:  # the engine is configured where it runs
        defaults = EngineArgs(model=args.model)
        options = {k: v for k, v in options.items()
                   if k in FRONTEND_OPTIONS and v != getattr(defaults, k)}
    engine = AsyncLLM(args.model, engine_address=engine_address,
                      curve_secret_key=curve_secret_key,
                      curve_server_public_key=curve_server_public_key, **options)
    app = build_app(engine, served_model_name or args.model, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=max(1, round(shutdown_timeout)))
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done; with these as the
    # handlers it restores, that ends nothing and the process exits 0.
    previous: dict[signal.Signals, Any] = {
        sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("server stopped")
    return 0
