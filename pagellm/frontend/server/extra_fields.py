"""Fields a request carries that its API model does not know: accepted, and named in
the log once, as vLLM does ("The following fields were present in the request but
ignored: {...}").

Clients written for other servers send fields of their own (OpenAI's newer ones, a
framework's bookkeeping); refusing them breaks drop-in use, and dropping them silently
hides typos. So each unknown name is logged once, and the log is rate-limited: names
are the client's text (cut to MAX_NAME_CHARS, and repr() escapes newlines), and a client
sending a new name per request must not be able to flood the log or grow the server's
memory.
"""

from __future__ import annotations

import logging
import time
from functools import cache
from typing import Any

import msgspec

logger = logging.getLogger("pagellm")

MAX_NAME_CHARS = 64  # a logged field name is cut to this many characters
MAX_REMEMBERED = 1024  # names already logged (each is logged once)
LINES_PER_MINUTE = 10  # new names beyond this are counted, not logged


@cache
def _fields(kind: type) -> tuple[frozenset[str], dict[str, tuple[type, bool]]]:
    """(the Struct's JSON field names, name -> (nested Struct type, is a list of it))."""
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    nested: dict[str, tuple[type, bool]] = {}
    for field in info.fields:
        options = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) \
            else (field.type,)
        for option in options:
            if isinstance(option, msgspec.inspect.StructType):
                nested[field.encode_name] = (option.cls, False)
            elif isinstance(option, msgspec.inspect.ListType) and \
                    isinstance(option.item_type, msgspec.inspect.StructType):
                nested[field.encode_name] = (option.item_type.cls, True)
    return frozenset(f.encode_name for f in info.fields), nested


def unknown_fields(data: bytes, kind: type) -> list[str]:
    """The field names in the JSON object `data` that the Struct `kind` (and the Structs
    nested in it: messages, stream_options) does not have, as paths (`messages[0].x`).
    `data` has already decoded as `kind`, so the shapes are known to match; values are
    not parsed again (msgspec.Raw), only the objects that hold nested Structs."""
    found: list[str] = []

    def walk(raw: bytes, kind: type, path: str) -> None:
        obj = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
        known, nested = _fields(kind)
        for name, value in obj.items():
            where = f"{path}.{name}" if path else name
            if name not in known:
                found.append(where)
            elif name in nested and bytes(value).strip() != b"null":
                inner, is_list = nested[name]
                if is_list:
                    items = msgspec.json.decode(value, type=list[msgspec.Raw])
                    for i, item in enumerate(items):
                        walk(bytes(item), inner, f"{where}[{i}]")
                else:
                    walk(bytes(value), inner, where)

    walk(data, kind, "")
    return found


class IgnoredFieldsLog:
    """Logs each ignored field name once, at most LINES_PER_MINUTE lines a minute; names
    over the rate are counted and the count goes into the next line that is logged."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.logged: set[str] = set()
        self.window_start = clock()
        self.lines_in_window = 0
        self.suppressed = 0

    def note(self, names: list[str]) -> None:
        new = sorted({n[:MAX_NAME_CHARS] for n in names} - self.logged)
        if not new:
            return
        now = self.clock()
        if now - self.window_start >= 60:
            self.window_start, self.lines_in_window = now, 0
        if self.lines_in_window >= LINES_PER_MINUTE:
            self.suppressed += 1
            return
        self.lines_in_window += 1
        if len(self.logged) < MAX_REMEMBERED:
            self.logged.update(new)
        note = f" ({self.suppressed} more such warnings were suppressed)" \
            if self.suppressed else ""
        self.suppressed = 0
        # Formatted here: pagellm's logger rate-limits by template, and each set of
        # names must get its one line (this class bounds the rate instead).
        logger.warning(f"The following fields were present in the request but ignored: "
                       f"{set(new)}{note}")
