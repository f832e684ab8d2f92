"""`EngineArgs` as command-line flags: one `--flag-name` per dataclass field, and back.

engine_args.py defines the options once, with their help, choices and checks; this is
how any such dataclass meets argparse, kept apart so the option table reads on its own:
the flags derived from its fields (`--max-model-len`, `--no-enable-prefix-caching`), the
flags that rebuild a given set of args (how a frontend starts its engine-core process),
the args parsed flags give (a refused value names its flag), and the parsers of the
values a type alone does not say how to read (sizes in bytes, JSON objects).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from fractions import Fraction
from typing import Any, TypeVar

from pagellm.protocol.validation import INT64_MAX

T = TypeVar("T")


def add_cli_args(cls: type[Any], parser: argparse.ArgumentParser, *,
                 model_positional: bool = False) -> argparse.ArgumentParser:
    """Add one `--flag-name` per field of the dataclass `cls` (`model` as a positional
    when asked)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(cls):
        kind, optional = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if f.name == "model":
            if model_positional:
                group.add_argument("model", help=help_text)
            else:
                group.add_argument("--model", required=True, help=help_text)
            continue
        flags = ["--" + f.name.replace("_", "-"), *(
            [f.metadata["alias"]] if "alias" in f.metadata else [])]
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
            continue
        for key, key_kind in f.metadata.get("keys", {}).items():  # --config.key value
            group.add_argument(f"{flags[0]}.{key}", dest=f"{f.name}.{key}",
                               type=_parse_bool if key_kind is bool else key_kind,
                               default=None, help=f"{f.name}'s {key!r} alone")
        convert: Any = parse_bytes if f.name.endswith("_bytes") else \
            parse_json if kind is dict else kind
        if optional:
            convert = _optional(convert)
        group.add_argument(*flags, type=convert, default=f.default,
                           choices=f.metadata.get("choices"),
                           help=f"{help_text} (default: {f.default})")
    return parser


def to_cli_args(args: Any) -> list[str]:
    """The flags that rebuild the dataclass instance `args` (non-defaults only)."""
    argv = ["--model", args.model]
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name == "model" or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def from_cli_args(cls: type[T], namespace: argparse.Namespace) -> T:
    """The `cls` the parsed flags give; a value refused names its flag
    ("--max-num-seqs: max_num_seqs must be <= ...")."""
    values = dict(vars(namespace))
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    for f in fields:  # `--config.key value` flags go into their dict
        for key in f.metadata.get("keys", {}):
            value = values.pop(f"{f.name}.{key}", None)
            if value is not None:
                values[f.name] = {**(values.get(f.name) or {}), key: value}
    try:
        return cls(**{f.name: values[f.name] for f in fields if f.name in values})
    except (ValueError, TypeError) as e:
        name = next((f.name for f in fields if re.match(rf"{f.name}\b", str(e))), None)
        if name is None:
            raise
        raise type(e)(f"--{name.replace('_', '-')}: {e}") from None


def _base_type(hint: Any) -> tuple[type, bool]:
    """(int, True) for `int | None`; (str, False) for `str`; (dict, True) for
    `dict[str, Any] | None`."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        optional = True
    return typing.get_origin(hint) or hint, optional


def parse_json(text: str) -> dict[str, Any]:
    """A JSON object from the command line (`--weight-transfer-config '{...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {_clip(text)} ({e})") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"JSON nested too deeply: {_clip(text)}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {_clip(text)}")
    return value


def _parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {_clip(text)}")
    return text.lower() == "true"


def _clip(text: str) -> str:
    """A command-line value for a message: a megabyte of it is not worth echoing."""
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}...({len(text)} characters)"


def _optional(convert: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'4GiB' -> 4294967296; plain integers pass through. Exact (no float rounding or
    overflow), and at most INT64_MAX bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {_clip(text)} "
                                         "(try 4GiB or 512MiB)")
    whole = m.group(1).lstrip("0").partition(".")[0]
    if len(whole) > 25:  # far beyond INT64_MAX in any unit: not worth the arithmetic
        value = INT64_MAX + 1
    else:
        value = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
    if value > INT64_MAX:
        raise argparse.ArgumentTypeError(f"{_clip(text)} is too large (at most {INT64_MAX} "
                                         "bytes)")
    return value
