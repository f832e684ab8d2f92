"""Live processes for tests: a `pagellm serve` server and standalone engine cores, each
stopped by its owner (a fixture or a `finally`); and a client of the engine core
written from the protocol alone (`RawEngineClient`, `request` for what it sends)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil

if TYPE_CHECKING:
    from pagellm.protocol.messages import EngineCoreRequest

ROOT = Path(__file__).resolve().parents[2]  # the repository
SUPPORT = Path(__file__).resolve().parent  # tests/support: what engine processes import
NAME = "test-model"
KV = str(8 * 2**20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_dir: Path, address: str, *extra: str,
                 module: str = "pagellm.enginecore") -> subprocess.Popen:
    cmd = [sys.executable, "-m", module] + (["engine-core"] if module == "pagellm" else [])
    return subprocess.Popen([*cmd, "--model", str(model_dir), "--kv-cache-memory-bytes", KV,
                             "--address", address, *extra], cwd=ROOT)


def stop(engine: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if engine.poll() is None:
        engine.send_signal(sig)
    try:
        return engine.wait(20)
    except subprocess.TimeoutExpired:
        engine.send_signal(signal.SIGUSR1)  # faulthandler: print every thread's stack
        time.sleep(1)
        raise
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


class Server:
    """`pagellm serve` on 127.0.0.1; with `log`, its stderr goes to that file."""

    def __init__(self, model_dir: Path, *flags: str, log: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PAGELLM_LOG_LEVEL": "WARNING", **(env or {})}
        self.log = None if log is None else open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagellm", "serve", str(model_dir), "--port",
             str(self.port), "--served-model-name", NAME, "--kv-cache-memory-bytes", "8MiB",
             *flags], cwd=ROOT, env=env, stderr=self.log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited during start-up"
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server did not come up")

    def log_lines(self) -> int:
        """Lines the server has written to its log file so far."""
        assert self.log is not None
        return Path(self.log.name).read_bytes().count(b"\n")

    def request(self, method: str, path: str, body: object = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get(self, path: str) -> tuple[int, bytes]:
        return self.request("GET", path)

    def post(self, path: str, body: object, **kw: dict[str, str]) -> tuple[int, dict]:
        status, data = self.request("POST", path, body, **kw)
        return status, json.loads(data)

    def client(self, key: str = "none") -> Any:
        """An OpenAI SDK client (imported here: the GPU machine's image has no openai,
        and every test module imports this file through conftest)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1].decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{"))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.log is not None:
                self.log.close()

    def engine_pid(self) -> int:
        children = psutil.Process(self.proc.pid).children(recursive=True)
        return next(c.pid for c in children if "pagellm.enginecore" in " ".join(c.cmdline()))


class RawEngineClient:
    """A client of the engine core written from the protocol alone, as a foreign
    client would be: a DEALER to the engine's address and a PULL for its outputs."""

    def __init__(self, address: str, connect_output: bool = True, rcvhwm: int = 0,
                 hello_timeout_s: float = 10.0) -> None:
        """`hello_timeout_s`: how long the engine may take to answer HELLO (it binds
        before it loads the model, and answers once loaded)."""
        import zmq

        from pagellm.transport.sockets import Context

        self.context = Context()  # a leaked client never blocks its finalizer
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(address)
        self.address = address
        self.output = None
        self.reply = raw_hello(self.dealer, hello_timeout_s)
        if connect_output and self.reply.error is None:
            self.output = self.context.socket(zmq.PULL)
            self.output.setsockopt(zmq.LINGER, 0)
            self.output.setsockopt(zmq.RCVHWM, rcvhwm)
            if rcvhwm:
                self.output.setsockopt(zmq.RCVBUF, 4096)
            if self.reply.output_password is not None:
                self.output.plain_username = b"pagellm"
                self.output.plain_password = self.reply.output_password.encode()
            connected = self.output.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self.output.connect(self.reply.output_endpoint)
            # The engine drops outputs for a client that has not connected yet: wait.
            assert connected.poll(10_000), "could not connect to the output endpoint"
            self.output.disable_monitor()
            connected.close(linger=0)

    def hello(self) -> Any:
        return raw_hello(self.dealer)

    def send(self, kind: Any, payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
        self.dealer.send_multipart([kind.value, data])

    def outputs_until(self, done: Callable[[Any], bool], timeout: float = 30.0) -> list[Any]:
        """Every EngineCoreOutput received until `done(output)` is true for one."""
        from pagellm.protocol.messages import EngineCoreOutputs

        assert self.output is not None
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.output.poll(100):
                continue
            message = msgspec.msgpack.decode(self.output.recv(), type=EngineCoreOutputs)
            if message.engine_dead is not None:
                raise RuntimeError(f"engine dead: {message.engine_dead}")
            for output in message.outputs:
                got.append(output)
                if done(output):
                    return got
        raise TimeoutError(f"no matching output within {timeout} s; got {got}")

    def finished(self, request_id: str, timeout: float = 30.0) -> Any:
        """The final output of `request_id`."""
        outputs = self.outputs_until(
            lambda o: o.request_id == request_id and o.finish_reason is not None, timeout)
        return outputs[-1]

    def close(self) -> None:
        self.context.destroy(linger=0)


def raw_hello(dealer: Any, timeout_s: float = 10.0) -> Any:
    """Send HELLO on a DEALER connected to an engine core; its HandshakeReply."""
    from pagellm.protocol.messages import (
        PROTOCOL_VERSION,
        HandshakeReply,
        HandshakeRequest,
        RequestType,
    )

    dealer.send_multipart([RequestType.HELLO.value,
                           msgspec.msgpack.encode(HandshakeRequest(PROTOCOL_VERSION))])
    assert dealer.poll(int(timeout_s * 1000)), "no answer to HELLO"
    return msgspec.msgpack.decode(dealer.recv(), type=HandshakeReply)


def request(request_id: str, prompt: list[int], **params: Any) -> EngineCoreRequest:
    """An engine-core request as a foreign client sends it: greedy and 4 tokens unless
    `params` say otherwise (`eos_token_id` among them is the request's own)."""
    from pagellm import SamplingParams
    from pagellm.protocol.messages import EngineCoreRequest

    fields = {"max_tokens": 4, "temperature": 0.0, **params}
    eos = fields.pop("eos_token_id", None)
    return EngineCoreRequest(request_id, prompt, SamplingParams(**fields), eos, time.time())
