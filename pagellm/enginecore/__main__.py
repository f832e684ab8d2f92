"""`python -m pagellm.enginecore --model DIR|demo [engine flags] --address tcp://HOST:PORT`

A standalone engine core for supervisors (systemd, Kubernetes, an RL trainer): it
binds one address, frontends attach there (`LLM(..., engine_address=ADDR)`), and it
runs until SIGTERM, then finishes what runs for up to --shutdown-timeout seconds.
Frontends that start their own engine core run this same module.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from pagellm.logger import configure_logging
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import READY, StartupFailure
from pagellm.protocol.validation import MAX_SHUTDOWN_TIMEOUT_S, check_float
from pagellm.vllm_alias import install_from_environment

logger = logging.getLogger("pagellm")


def build_parser(prog: str = "python -m pagellm.enginecore") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    net = parser.add_argument_group("serving")
    net.add_argument("--address", default=None,
                     help="where frontends attach: tcp://HOST:PORT or ipc://PATH")
    net.add_argument("--headless", action="store_true",
                     help="run only this node's tensor-parallel workers (--nnodes > 1, "
                          "--node-rank > 0); they join node 0's engine core at "
                          "--master-addr:--master-port")
    net.add_argument("--curve-secret-key", type=Path, default=None,
                     help="this engine's CURVE key pair (a zmq.auth '.key_secret' file); "
                          "required to bind a non-loopback TCP address")
    net.add_argument("--curve-authorized-keys", type=Path, default=None,
                     help="directory of the public keys of frontends allowed to attach")
    net.add_argument("--shutdown-timeout", type=float, default=5.0,
                     help="on SIGTERM/SIGINT, seconds running requests may still finish "
                          "before they are aborted (a second signal stops at once; "
                          "default: 5)")
    # Used by a frontend that launches its own engine core.
    net.add_argument("--status-fd", type=int, default=None, help=argparse.SUPPRESS)
    net.add_argument("--lifeline-fd", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m pagellm.enginecore") -> int:
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    if (ns.curve_secret_key is None) != (ns.curve_authorized_keys is None):
        parser.error("--curve-secret-key and --curve-authorized-keys go together")
    try:
        check_float("--shutdown-timeout", ns.shutdown_timeout, minimum=0,
                    maximum=MAX_SHUTDOWN_TIMEOUT_S)
    except ValueError as e:
        parser.error(str(e))
    if (ns.address is None) != ns.headless:
        parser.error("--address is required (and --headless takes none)")
    configure_logging()
    install_from_environment()  # worker extensions may import vllm.*
    if ns.headless:
        from pagellm.executor.worker.memory import tune_engine_process
        from pagellm.executor.worker_node import run_worker_node

        tune_engine_process()
        try:
            args = EngineArgs.from_cli_args(ns)
            return run_worker_node(args)
        except ValueError as e:
            parser.error(str(e))
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    sockets = None
    try:
        from pagellm.transport.sockets import CurveServerKeys, SocketFactory, bind_frontends

        curve = (CurveServerKeys(ns.curve_secret_key, ns.curve_authorized_keys)
                 if ns.curve_secret_key is not None else None)
        args = EngineArgs.from_cli_args(ns)
        # Bound first (refusing an unsafe address), before torch is imported and the model
        # loads: a frontend attaching meanwhile waits for READY instead of being refused.
        # A launched engine (it has a lifeline) owns its socket directory.
        sockets = SocketFactory(ns.address, curve, owns_directory=ns.lifeline_fd is not None)
        frontends = bind_frontends(sockets)
        from pagellm.executor.worker.memory import tune_engine_process

        tune_engine_process()
        from pagellm.demo.model import resolve_model
        from pagellm.enginecore.proc import EngineCoreProc
        from pagellm.weights.gguf import resolve_gguf

        proc = EngineCoreProc(resolve_gguf(resolve_model(args)), sockets, frontends,
                              ns.lifeline_fd, ns.shutdown_timeout)
        if ns.status_fd is not None:
            os.write(ns.status_fd, READY)
    except Exception as e:
        logger.error("engine core failed to start: %s: %s\n%s", type(e).__name__, e,
                     traceback.format_exc())
        if ns.status_fd is not None:
            import msgspec

            os.write(ns.status_fd, msgspec.msgpack.encode(StartupFailure(str(e),
                                                                         type(e).__name__)))
        if sockets is not None:  # refuse further connections at once
            sockets.close()
        if ns.lifeline_fd is not None and ns.address.startswith("ipc://"):
            # Launched: the socket directory is ours (see SocketFactory).
            shutil.rmtree(Path(ns.address.removeprefix("ipc://")).parent, ignore_errors=True)
        return 1
    code = proc.run()
    # Nothing is left to clean up: skip interpreter teardown (torch's and zmq's exit hooks
    # could only delay a supervisor's restart).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
