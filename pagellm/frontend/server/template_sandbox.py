"""Chat templates sent by clients, rendered in a child process that can be killed.

A Jinja template is a program. transformers renders chat templates in Jinja's sandboxed
environment, which stops a template from reaching Python's internals but not from
looping for hours or building a string of many gigabytes (vLLM's CVE-2025-61620 is a
template that stalls the server). So the server renders templates it did not ship
with (only with --trust-request-chat-template) here:

    server (tokenizer thread)  ── length-prefixed msgpack ──▶  python -m ...template_sandbox
    render(...) -> text        ◀── text, or the error ───────  tokenizer loaded once,
                                                                memory capped (RLIMIT_DATA)

A render that takes longer than `timeout_s` kills the child (a new one starts for the
next template) and fails that request alone. The child exits when the server does:
its stdin reaches end of file.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

_LENGTH = struct.Struct("<I")
RENDER_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0
MEMORY_LIMIT_BYTES = 2**30  # what a render may allocate beyond the loaded tokenizer
MAX_RENDERED_CHARS = 16 * 2**20


class RenderRequest(msgspec.Struct, array_like=True):
    template: str
    conversation: list[dict[str, Any]]
    add_generation_prompt: bool
    kwargs: dict[str, Any]


class RenderReply(msgspec.Struct, array_like=True, omit_defaults=True):
    text: str | None = None
    error: str | None = None


class TemplateTimeout(Exception):
    """The template ran past the time limit and its process was killed."""


class ChatTemplateSandbox:
    """Renders untrusted chat templates, one at a time, in a killable child process."""

    def __init__(self, tokenizer_dir: str, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False

    def render(self, template: str, conversation: list[dict[str, Any]],
               add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        """The rendered text; ValueError for a template error, TemplateTimeout when it
        ran too long. Blocking: call it from a worker thread."""
        request = msgspec.msgpack.encode(RenderRequest(template, conversation,
                                                       add_generation_prompt, kwargs))
        with self._lock:
            if self._closed:
                raise RuntimeError("the chat template sandbox is closed")
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(_LENGTH.pack(len(request)) + request)
                proc.stdin.flush()
                data = _read_frame(proc.stdout.fileno(), self.timeout_s)
            except TimeoutError:
                self._kill()
                raise TemplateTimeout(f"the chat template did not finish within "
                                      f"{self.timeout_s:g} s") from None
            except (OSError, EOFError) as e:  # the child died (e.g. out of memory)
                self._kill()
                raise ValueError(f"the chat template failed: its renderer died ({e})"
                                 ) from None
        reply = msgspec.msgpack.decode(data, type=RenderReply)
        if reply.error is not None:
            raise ValueError(f"the chat template failed: {reply.error}")
        return reply.text or ""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._kill()

    def _child(self) -> subprocess.Popen[bytes]:
        """The renderer, started (and waited for: its start-up does not count against
        a template's time) if there is none."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pagellm.frontend.server.template_sandbox",
                 self.tokenizer_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert self._proc.stdout is not None
            try:
                _read_frame(self._proc.stdout.fileno(), START_TIMEOUT_S)  # "ready"
            except (TimeoutError, EOFError, OSError) as e:
                self._kill()
                raise RuntimeError(f"the chat template sandbox did not start: {e!r}") from None
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            self._proc = None


def _read_frame(fd: int, timeout_s: float | None) -> bytes:
    """One length-prefixed frame from `fd`; TimeoutError if it is not complete within
    timeout_s (None: wait), EOFError if the other end closed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    buffer = b""
    needed = _LENGTH.size
    header = True
    while True:
        while len(buffer) < needed:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(fd, needed - len(buffer))
            if not chunk:
                raise EOFError("end of file")
            buffer += chunk
        if not header:
            return buffer
        (needed,) = _LENGTH.unpack(buffer)
        buffer, header = b"", False


def _serve(tokenizer_dir: str) -> None:
    """The child: load the tokenizer, cap memory, then render until end of file."""
    replies = os.dup(1)
    os.dup2(2, 1)  # whatever a library prints must not corrupt the replies
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    _cap_memory(MEMORY_LIMIT_BYTES)
    os.write(replies, _LENGTH.pack(0))  # ready
    decoder = msgspec.msgpack.Decoder(RenderRequest)
    stdin = sys.stdin.fileno()
    while True:
        try:
            request = decoder.decode(_read_frame(stdin, None))
        except EOFError:
            return
        try:
            text = tokenizer.apply_chat_template(
                request.conversation, chat_template=request.template,
                add_generation_prompt=request.add_generation_prompt, tokenize=False,
                **request.kwargs)
            if not isinstance(text, str) or len(text) > MAX_RENDERED_CHARS:
                raise ValueError(f"the template must render to a string of at most "
                                 f"{MAX_RENDERED_CHARS} characters")
            reply = RenderReply(text=text)
        except MemoryError:
            reply = RenderReply(error=f"it needs more than {MEMORY_LIMIT_BYTES >> 20} MiB")
        except Exception as e:
            reply = RenderReply(error=f"{type(e).__name__}: {e}")
        data = msgspec.msgpack.encode(reply)
        os.write(replies, _LENGTH.pack(len(data)) + data)


def _cap_memory(extra_bytes: int) -> None:
    """Limit the data segment (heap and private mappings) to what is used now plus
    `extra_bytes`: a template that builds a huge string gets a MemoryError, not the
    machine's memory."""
    used = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                used = int(line.split()[1]) * 1024
    limit = used + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


if __name__ == "__main__":
    _serve(sys.argv[1])
