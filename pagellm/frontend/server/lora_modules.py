"""`LoRAModules`: the adapters a server serves by name (vLLM's `--lora-modules`).

A request's `model` field picks one (the served model's own name picks the base model);
/v1/models lists them with `parent` = the base model. Adapters come from
`--lora-modules name=path` or its JSON form `{"name": ..., "path": ...,
"base_model_name": ...}`, and at run time from /v1/load_lora_adapter and
/v1/unload_lora_adapter, which exist only where the operator allows them
(VLLM_ALLOW_RUNTIME_LORA_UPDATING, vLLM's switch: the body names a path on the server's
disk, which only a trusted client may do) and sit behind the API key. Ids are assigned
here, one per name, never reused; the engine reads and checks each adapter when it is
loaded (or first named), so a bad one is that request's error.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence

import msgspec

from pagellm.protocol.lora import MAX_LORA_NAME_CHARS, LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_SERVED_LORAS = 4096


def runtime_updates_from_env(environ: Mapping[str, str]) -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it: "1" or "true" (any case)."""
    return environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


def parse_lora_modules(specs: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """`--lora-modules` values -> (name, path, base_model_name); ValueError naming a bad
    one."""
    modules: list[tuple[str, str, str | None]] = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                raw = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {spec[:60]!r}: not JSON ({e})") from None
            if not isinstance(raw, dict) or set(raw) - {"name", "path", "base_model_name"} \
                    or not isinstance(raw.get("name"), str) \
                    or not isinstance(raw.get("path"), str) \
                    or not isinstance(raw.get("base_model_name", ""), str | None):
                raise ValueError(f"--lora-modules {spec[:60]!r}: expected "
                                 '{"name": str, "path": str, "base_model_name": str}')
            modules.append((raw["name"], raw["path"], raw.get("base_model_name")))
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec[:60]!r}: expected name=path or JSON")
            modules.append((name, path, None))
    return modules


class LoRAModules:
    def __init__(self, base_name: str) -> None:
        self.base_name = base_name
        self.served: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None,
            load_inplace: bool = False) -> LoRARequest:
        """Serve `name` (a new id), or with load_inplace replace its weights (same id)."""
        if name == self.base_name:
            raise ValueError(f"the adapter name {name!r} is the base model's")
        if not re.fullmatch(r"[^\x00-\x1f]+", name) or len(name) > MAX_LORA_NAME_CHARS:
            raise ValueError(f"an adapter name must have 1 to {MAX_LORA_NAME_CHARS} "
                             "printable characters")
        known = self.served.get(name)
        if known is not None and not load_inplace:
            raise ValueError(f"the adapter {name!r} is already loaded (load_inplace=true "
                             "replaces its weights)")
        if known is None and len(self.served) >= MAX_SERVED_LORAS:
            raise ValueError(f"{MAX_SERVED_LORAS} adapters are served: unload one first")
        return LoRARequest(name, known.lora_int_id if known else next(self._ids), path,
                           base_model_name or self.base_name, load_inplace=load_inplace)

    def commit(self, lora: LoRARequest) -> None:
        """`lora` (from `add`) is loaded in the engine: serve it."""
        self.served[lora.lora_name] = msgspec.structs.replace(lora, load_inplace=False)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); KeyError when
        it names nothing served."""
        if model is None or model == self.base_name:
            return None
        return self.served[model]

    def remove(self, name: str) -> LoRARequest:
        """Stop serving `name` (KeyError if it is not)."""
        return self.served.pop(name)
