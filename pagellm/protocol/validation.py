"""Range checks shared by everything a client can set (`SamplingParams`, `EngineArgs`,
the engine core's checks of foreign requests).

Every integer or float a client sends ends up in a tensor, a numpy array, a msgpack
frame or an allocation, each with a fixed width; a value outside it must be refused
where it enters, with a message that names the field and the allowed range, and never
surface as an OverflowError deep inside the engine loop. These bounds are the widths
of those destinations.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

INT32_MAX = 2**31 - 1  # counts that land in int32 arrays (token counts, top-k, ...)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds, priorities: msgpack's int64
FLOAT32_MAX = 3.4028234663852886e38  # per-row sampling values live in float32 tensors


def _is_int(value: Any) -> bool:
    # bool is a subclass of int; `max_tokens=True` is a bug in the caller, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int | None = None,
              maximum: int | None = None, allow_none: bool = False) -> None:
    """Raise TypeError/ValueError naming `name` unless `value` is an int in range."""
    if value is None and allow_none:
        return
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(_out_of_range(name, f">= {minimum}", minimum, maximum, "[", value))
    if maximum is not None and value > maximum:
        raise ValueError(_out_of_range(name, f"<= {maximum}", minimum, maximum, "[", value))


def check_float(name: str, value: Any, *, minimum: float | None = None,
                maximum: float | None = None, min_exclusive: bool = False) -> None:
    """Raise TypeError/ValueError naming `name` unless `value` is a finite number in
    range (ints are numbers too, however large)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    lower = "(" if min_exclusive else "["
    if minimum is not None and (value <= minimum if min_exclusive else value < minimum):
        bound = f"{'>' if min_exclusive else '>='} {_fmt(minimum)}"
        raise ValueError(_out_of_range(name, bound, minimum, maximum, lower, value))
    if maximum is not None and value > maximum:
        raise ValueError(_out_of_range(name, f"<= {_fmt(maximum)}", minimum, maximum, lower,
                                       value))


MAX_HOST_CHARS = 253  # DNS's limit for a whole name
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[?[0-9A-Fa-f:.]+\]?")


def check_host(name: str, value: Any) -> None:
    """Raise ValueError naming `name` unless `value` is a host name or an IPv4 / IPv6
    address (IPv6 optionally in brackets) of at most MAX_HOST_CHARS: what a socket is
    pointed at, never text of a client's choosing for a resolver, a connect loop or a
    log line to carry."""
    if not isinstance(value, str) or len(value) > MAX_HOST_CHARS or not _HOST.fullmatch(value):
        raise ValueError(f"{name} must be a host name or IP address of at most "
                         f"{MAX_HOST_CHARS} characters, got {_short_repr(value)}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


# Layers beyond any real model's (the largest have a few hundred): each costs host
# memory for its modules before any weight exists, so a config claiming millions would
# exhaust memory building them.
MAX_NUM_LAYERS = 4096
# --shutdown-timeout (server and engine core): finite, and at most a day.
MAX_SHUTDOWN_TIMEOUT_S = 86400.0

# RoPE scaling fields (config.json's rope_parameters / rope_scaling) -> strictly
# positive (True) or any finite number (False).
_ROPE_NUMBERS = {"rope_theta": True, "factor": True, "low_freq_factor": True,
                 "high_freq_factor": True, "attention_factor": True, "beta_fast": False,
                 "beta_slow": False, "mscale": False, "mscale_all_dim": False,
                 "partial_rotary_factor": True}
# The fields each scaling type needs (transformers refuses the config without them).
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def check_model_config(config: Any) -> None:
    """Raise ValueError, "config.json: <field> must be ...", unless `config` (a
    config.json's contents) passes `_check_model_config`."""
    try:
        _check_model_config(config)
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from None


def read_json_object(path: Path, max_bytes: int) -> dict[str, Any]:
    """A small JSON file a user or client points at (generation_config.json, a LoRA
    adapter's config), bounded in size before it is read: a ValueError names the file
    when it is too large, not JSON or not an object."""
    if path.stat().st_size > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes")
    try:
        value = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def load_model_config(directory: Path) -> Any:
    """`directory`'s config.json as transformers' config, checked twice: our bounds
    (`check_model_config`), then transformers' own checks. Either refusal is a
    one-line ValueError naming the file. The frontend calls this before it starts an
    engine core, so a bad config is refused in the caller's process, not in a child's
    traceback; the engine core calls it again for the model it builds."""
    from transformers import AutoConfig

    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {directory} has no config.json")
    try:
        check_model_config(json.loads(path.read_text()))
    except ValueError as e:  # "config.json: <field> ...": give its full path
        raise ValueError(f"{path}: {str(e).removeprefix('config.json: ')}") from e
    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as e:
        # transformers' own checks: ValueError, KeyError, huggingface_hub's
        # StrictDataclassError...
        if not isinstance(e, (ValueError, TypeError, KeyError, ArithmeticError)) and \
                not type(e).__module__.startswith(("transformers", "huggingface_hub")):
            raise
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        raise ValueError(f"{path}: {' '.join(text.split())}") from e


def _check_model_config(config: Any) -> None:
    """The sizes a model's config.json gives, each checked by name before transformers
    reads them (the frontend for the tokenizer, the engine for the model): a zero or a
    fraction would otherwise surface as a ZeroDivisionError or a shape error deep in
    config or model construction, and a size beyond int32 (or layers beyond
    `MAX_NUM_LAYERS`) as an allocator error; a mixture of experts' counts and widths
    likewise (top-k within the experts). The RoPE fields are checked too. Whether
    the weights fit in memory is the loader's check (executor/model/loader.py)."""
    if not isinstance(config, dict):
        raise ValueError("config.json must hold a JSON object")
    text = config.get("text_config")
    if isinstance(text, dict) and "vocab_size" not in config:
        try:  # a multimodal checkpoint's: the model built is its text model
            _check_model_config(text)
        except ValueError as e:
            raise ValueError(f"text_config.{e}") from None
        return
    sizes = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "max_position_embeddings"]
    sizes += [name for name in ("num_key_value_heads", "head_dim", "num_experts",
                                "moe_intermediate_size",
                                # Granite 4.0's shared MLP and Mamba-2 layers
                                "shared_intermediate_size", "mamba_n_heads",
                                "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                                # DeepSeek's latent attention and experts
                                "n_routed_experts", "kv_lora_rank", "q_lora_rank",
                                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                "n_group", "topk_group") if config.get(name) is not None]
    for name in sizes:
        value = config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {_short_repr(value)}")
        limit = MAX_NUM_LAYERS if name == "num_hidden_layers" else INT32_MAX
        if value > limit:
            raise ValueError(_out_of_range(name, f"<= {limit}", 1, limit, "[", value))
    for name in ("shared_expert_intermediate_size", "n_shared_experts",
                 "first_k_dense_replace",
                 "num_local_experts", "num_experts_per_tok"):  # (Granite 4.0: 0, none)
        value = config.get(name)
        if value is not None and (not _is_int(value) or not 0 <= value <= INT32_MAX):
            raise ValueError(f"{name} must be an integer in [0, {INT32_MAX}], got "
                             f"{_short_repr(value)}")
    experts = next((config[name] for name in ("num_experts", "num_local_experts",
                                              "n_routed_experts")
                    if config.get(name) is not None), None)
    top_k = config.get("num_experts_per_tok")
    if experts and top_k is not None and not 1 <= top_k <= experts:  # (none: unread)
        raise ValueError(f"num_experts_per_tok ({top_k}) must be from 1 to the number of "
                         f"experts ({experts})")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        raise ValueError(f"hidden_size ({config['hidden_size']}) must be a multiple of "
                         f"num_attention_heads ({heads}) when there is no head_dim")
    for name in ("rope_theta", "rms_norm_eps", "swiglu_alpha", "swiglu_limit",
                 "routed_scaling_factor"):
        if config.get(name) is not None:  # (gpt-oss's experts, DeepSeek's routing)
            try:
                check_float(name, config[name], minimum=0.0, min_exclusive=True)
            except TypeError as e:
                raise ValueError(str(e)) from None
    for field in ("rope_parameters", "rope_scaling"):
        _check_rope(field, config.get(field))


def _check_rope(field: str, params: Any) -> None:
    """config.json's `field` (rope_parameters or rope_scaling): None or an object whose
    scaling numbers are numbers in range (nested objects: one per layer type)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"{field} must be a JSON object, got {_short_repr(params)}")
    for key, value in params.items():
        name = f"{field}.{key}"
        if isinstance(value, dict):
            _check_rope(name, value)
        elif key in ("rope_type", "type"):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {_short_repr(value)}")
        elif key == "original_max_position_embeddings":
            if value is not None and (not _is_int(value) or not 1 <= value <= INT32_MAX):
                raise ValueError(f"{name} must be a positive integer (<= {INT32_MAX}), got "
                                 f"{_short_repr(value)}")
        elif key in _ROPE_NUMBERS and value is not None:
            try:
                check_float(name, value, minimum=0.0 if _ROPE_NUMBERS[key] else None,
                            min_exclusive=True)
            except TypeError as e:
                raise ValueError(str(e)) from None
    rope_type = params.get("rope_type", params.get("type"))
    required = _ROPE_REQUIRED.get(rope_type, ()) if isinstance(rope_type, str) else ()
    absent = [key for key in required if params.get(key) is None]
    if absent:
        raise ValueError(f"{field} of rope_type {rope_type!r} needs {', '.join(absent)}")
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if low is not None and low == high:
        raise ValueError(f"{field}.low_freq_factor and high_freq_factor must differ, both "
                         f"are {low}")


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def _out_of_range(name: str, bound: str, minimum: float | None, maximum: float | None,
                  lower: str, value: float) -> str:
    """'top_k must be <= 2147483647 (allowed: [-1, 2147483647]), got 2**63'."""
    allowed = "" if minimum is None or maximum is None else \
        f" (allowed: {lower}{_fmt(minimum)}, {_fmt(maximum)}])"
    return f"{name} must be {bound}{allowed}, got {_short(value)}"


def _short(value: float) -> str:
    """A value for a message: an int of a thousand digits is not worth echoing."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


def _fmt(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) and abs(value) >= 1e6 else str(value)
