"""A tensor-parallel worker process: one rank's `Worker`, serving the calls the engine
core's `MultiprocExecutor` broadcasts (executor/multiproc.py has the wire format:
`CALL_TYPES`, `Reply`). Started as `python -m pagellm.executor.worker_proc` by
`spawn_worker`, on this node or (`--headless`) another; it exits when the engine core
does: its lifeline pipe's end of file, or the broadcast socket's disconnection.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import msgspec
import zmq

from pagellm.executor.multiproc import (
    CALL_TYPES,
    GROUP_TIMEOUT_S,
    SEQ,
    STARTUP_TIMEOUT_S,
    Reply,
)
from pagellm.executor.worker.worker import StepFailed, is_device_fault
from pagellm.lifeline import die_with_parent, wait_for_eof
from pagellm.logger import freeze_startup_heap
from pagellm.protocol.engine_args import EngineArgs

logger = logging.getLogger("pagellm")


def worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagellm.executor.worker_proc")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the TCPStore")
    parser.add_argument("--lifeline-fd", type=int, default=None)
    parser.add_argument("--die-with-parent", action="store_true")
    ns = parser.parse_args(argv)
    if ns.die_with_parent:  # started by its parent's main thread
        die_with_parent()  # (a parent that died before this: the lifeline's EOF)
    from pagellm.logger import configure_logging
    from pagellm.vllm_alias import install_from_environment

    configure_logging()
    install_from_environment()  # worker extensions may import vllm.*
    from pagellm.executor.worker.memory import tune_engine_process

    tune_engine_process()
    if ns.lifeline_fd is not None:
        threading.Thread(target=_exit_on_eof, args=(ns.lifeline_fd,), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    args = EngineArgs.from_cli_args(ns)
    host, _, port = ns.store.rpartition(":")
    _serve(args, ns.rank, ns.local_rank, host, int(port))
    os._exit(0)  # skip interpreter teardown (the process group's, zmq's)


def _serve(args: EngineArgs, rank: int, local_rank: int, host: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    from pagellm.executor.worker.extension import make_worker

    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    replies = ctx.socket(zmq.PUSH)
    replies.connect(store.get("pagellm/replies").decode())
    calls = ctx.socket(zmq.SUB)
    calls.setsockopt(zmq.SUBSCRIBE, b"")
    calls.setsockopt(zmq.RCVHWM, 0)
    gone = calls.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    calls.connect(store.get("pagellm/calls").decode())
    world = args.tensor_parallel_size
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        from pagellm.executor.worker.worker import device_for

        device = device_for(args, local_rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore("pagellm/tp", store), rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        worker = make_worker(args, rank, local_rank)
    except Exception as e:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        replies.send(msgspec.msgpack.encode(Reply(0, rank, type(e).__name__, str(e))))
        time.sleep(0.5)  # let the reply leave before the process does
        return
    replies.send(msgspec.msgpack.encode(Reply(0, rank)))
    decoders = {m: msgspec.msgpack.Decoder(t) for m, t in CALL_TYPES.items()}
    encoder = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(calls, zmq.POLLIN)
    poller.register(gone, zmq.POLLIN)
    while True:
        events = dict(poller.poll())
        if gone in events:
            logger.info("tensor-parallel rank %d: the engine core is gone", rank)
            return
        seq, method_bytes, payload = calls.recv_multipart()
        method = method_bytes.decode()
        header, result = Reply(SEQ.unpack(seq)[0], rank), b""
        try:
            value = getattr(worker, method)(*decoders[method].decode(payload))
            if rank == 0 or method != "execute_model":  # rank 0 speaks for the step
                result = encoder.encode(value)
        except Exception as e:
            if method != "execute_model" or not isinstance(e, StepFailed):
                logger.exception("tensor-parallel rank %d: %s failed", rank, method)
            header.error_type = ("DeviceFault" if is_device_fault(e)
                                 else type(e).__name__)
            header.message = str(e)
        replies.send_multipart([encoder.encode(header), result])
        if method == "initialize_kv_cache" and header.error_type is None:  # started
            freeze_startup_heap(f"tensor-parallel rank {rank}")  # see logger.py
        if method == "shutdown":
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            return


def _exit_on_eof(fd: int) -> None:
    """The engine core holds the other end of the lifeline."""
    wait_for_eof(fd)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(worker_main())
