"""`install_as_vllm()`: `import vllm` resolves to pagellm in this process (opt-in).

RL frameworks (TRL, OpenRLHF, verl) import vLLM by name, at module level and deep
inside: `vllm.sampling_params`, `vllm.utils.network_utils`,
`vllm.distributed.weight_transfer.packed_tensor`, ... As PyMySQL's
`install_as_MySQLdb()` does for MySQLdb, one call before importing the framework maps
the name `vllm` and every submodule pagellm serves onto `pagellm.vllm` (vLLM's import
tree, made of pagellm's own classes), so the framework runs unchanged:

    import pagellm
    pagellm.install_as_vllm()
    from trl import GRPOTrainer   # its `from vllm import LLM` is pagellm's LLM

Only this process, and the engine processes it starts (they inherit PAGELLM_AS_VLLM=1,
because worker extension classes import `vllm.*` in the engine too), see the alias;
no distribution named `vllm` is installed. A vLLM module pagellm does not serve is a
ModuleNotFoundError naming it, at the import. Refused when the real vLLM is already
imported (two libraries under one name would mix their objects).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from types import ModuleType

# The vLLM release whose API the alias serves: the frameworks' version gates read it
# (TRL 1.16 accepts 0.22-0.31 and takes its >= 0.28 paths; OpenRLHF 0.11 needs > 0.10).
VLLM_API_VERSION = "0.31.0"
# Set by install_as_vllm for the engine processes started from this one.
ENV_VAR = "PAGELLM_AS_VLLM"
_TARGET = "pagellm.vllm"

logger = logging.getLogger(__name__)


class _VllmAliasLoader(importlib.abc.Loader):
    """Loads `vllm.x` as the already-imported module `pagellm.vllm.x` (one module
    object under two names: a class keeps its real `__module__`, so pickling and
    `isinstance` agree across processes that never installed the alias)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._real_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (`create_module` returned the executed module), but undo
        the import system's stamping of the alias spec onto it: the module stays
        `pagellm.vllm.x` for everything that reads `__spec__`."""
        module.__spec__ = self._real_spec


class _VllmAliasFinder(importlib.abc.MetaPathFinder):
    """Answers for `vllm` and `vllm.*` before every other finder."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        name = _TARGET + fullname[len("vllm"):]
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: pagellm.install_as_vllm() serves only the "
                f"vLLM modules RL frameworks use (see pagellm/vllm/); {fullname} is not one "
                "of them", name=fullname)
        return importlib.util.spec_from_loader(
            fullname, _VllmAliasLoader(name),
            is_package=spec.submodule_search_locations is not None)


def _installed() -> bool:
    return any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path)


def install_as_vllm() -> None:
    """Make `import vllm` (and its submodules pagellm serves) resolve to pagellm in
    this process and the engine processes it starts. Idempotent. RuntimeError if the
    real vLLM is already imported."""
    existing = sys.modules.get("vllm")
    if existing is not None and not getattr(existing, "__name__", "").startswith(_TARGET):
        raise RuntimeError(
            "install_as_vllm(): the real vLLM is already imported in this process "
            f"({getattr(existing, '__file__', existing)}); call install_as_vllm() before "
            "anything imports vllm, or use vLLM itself")
    os.environ[ENV_VAR] = "1"
    if _installed():
        return
    if importlib.util.find_spec("vllm") is not None:  # before our finder: the real one
        logger.warning("install_as_vllm(): vLLM is installed; pagellm stands in for it in "
                       "this process")
    sys.meta_path.insert(0, _VllmAliasFinder())


def install_from_environment() -> None:
    """In an engine process: install the alias if the process that started it had
    (PAGELLM_AS_VLLM=1), so worker extensions importing `vllm.*` work there too."""
    if os.environ.get(ENV_VAR) == "1":
        install_as_vllm()
