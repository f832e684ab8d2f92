"""The `pagellm` command line: generate, make-model."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pagellm.frontend.server.lora_modules import parse_lora_modules, runtime_updates_from_env
from pagellm.frontend.server.options import (
    ENGINE_STALL_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_RESPONSE_ENTRIES,
    ServerOptions,
)
from pagellm.frontend.tool_parsers import TOOL_PARSERS
from pagellm.logger import configure_logging
from pagellm.protocol.cli_args import parse_bytes
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.validation import (
    INT64_MAX,
    MAX_SHUTDOWN_TIMEOUT_S,
    check_float,
    check_int,
)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts and print the results",
                       description="Complete prompts with a model (or --model demo).")
    EngineArgs.add_cli_args(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    s.add_argument("--ignore-eos", action="store_true")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=_generate)


def _generate(ns: argparse.Namespace) -> int:
    from pagellm.frontend.llm import LLM
    from pagellm.protocol.sampling_params import SamplingParams

    args = EngineArgs.from_cli_args(ns)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k, seed=ns.sampling_seed,
                            ignore_eos=ns.ignore_eos)
    if args.model == "demo":
        print("NOTE: 'demo' is a tiny model with RANDOM weights: it shows the engine "
              "working, its text is gibberish by design.", file=sys.stderr)
    with LLM(**vars(args)) as llm:
        start = time.perf_counter()
        outputs = llm.generate(ns.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    num_tokens = 0
    for output in outputs:
        completion = output.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"--- prompt: {output.prompt!r}")
        print(f"    completion ({len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason}): {completion.text!r}")
    print(f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} output tokens/s")
    return 0


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from pagellm.demo.model import ARCHS, DTYPES

    p = sub.add_parser("make-model", help="write a random-weight model and tokenizer",
                       description="Write a random-weight Hugging Face model directory with "
                       "a byte-level BPE tokenizer trained offline and a ChatML template.")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2, dest="num_layers")
    p.add_argument("--heads", type=int, default=4, dest="num_heads")
    p.add_argument("--kv-heads", type=int, default=2, dest="num_kv_heads")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction,
                   default=None, help="default: untied for llama, tied for qwen")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rope-scaling", type=json.loads, default=None,
                   help='JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    p.add_argument("--init-std", type=float, default=0.08)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--max-shard-size", default=None, help="e.g. 100KB: write shards")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.set_defaults(func=_make_model)


def _make_model(ns: argparse.Namespace) -> int:
    from pagellm.demo.model import ModelSpec, make_model

    fields = {k: v for k, v in vars(ns).items() if k not in ("command", "func", "out")}
    path = make_model(ns.out, ModelSpec(**fields))
    print(f"wrote a random-weight {ns.arch} model to {path}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start an OpenAI-compatible HTTP server",
                       description="Serve MODEL over an OpenAI-compatible HTTP API "
                       "(needs the 'serve' extra: pip install -e '.[serve]').")
    EngineArgs.add_cli_args(p, model_positional=True)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: MODEL as given)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, "
                        "/metrics and /version")
    s.add_argument("--engine-address", default=None,
                   help="attach to a running engine core instead of starting one")
    s.add_argument("--curve-secret-key", default=None,
                   help="this frontend's CURVE key pair, for an engine core that requires "
                        "CURVE (--engine-address, or data-parallel cores of other nodes); "
                        "with --headless, the key pair this node's engine cores serve with")
    s.add_argument("--curve-server-public-key", default=None,
                   help="the engine cores' CURVE public key; with --headless, the "
                        "frontend's")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests may finish after SIGTERM (default: 5)")
    s.add_argument("--max-body-size", type=parse_bytes, default=MAX_BODY_BYTES,
                   help="largest request body accepted, e.g. 16MiB (default: 16MiB)")
    s.add_argument("--max-connections", type=int, default=None,
                   help="most open HTTP connections; above it the connection idle longest "
                        "is closed (default: 2048, or fewer if file descriptors are short)")
    s.add_argument("--max-connections-per-client", type=int, default=None,
                   help="most open HTTP connections from one IP address; above it that "
                        "client's connection idle longest is closed, or the new one refused "
                        "(default: half of --max-connections). Behind a reverse proxy every "
                        "client is the proxy's address: raise it there")
    s.add_argument("--max-response-entries", type=int, default=MAX_RESPONSE_ENTRIES,
                   help="most token entries one request's response may hold: n x max_tokens "
                        "x (1 + logprobs), plus prompt tokens x (1 + prompt_logprobs); a "
                        f"larger request is a 400 (default: {MAX_RESPONSE_ENTRIES})")
    s.add_argument("--engine-stall-timeout", type=float, default=ENGINE_STALL_TIMEOUT_S,
                   help="seconds the engine core's loop may spend inside one step or "
                        "control call before /health and /ping answer 503 (default: "
                        f"{ENGINE_STALL_TIMEOUT_S:g})")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (rendered in a "
                        "sandboxed child process with a time limit)")
    s.add_argument("--chat-template", default=None,
                   help="the chat template for every chat request instead of the "
                        "tokenizer's: a file path, or the Jinja template itself")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto", the '
                        "default when a request has tools); needs --tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are found in the model's text: hermes (Qwen2.5, "
                        "Qwen3, Hermes), llama3_json (Llama 3.x), pythonic, deepseek_v3, "
                        "deepseek_v31, glm45 (GLM-4.5/4.6), glm47 (GLM-4.7), qwen3_coder "
                        "(Qwen3-Coder, Qwen3.5), qwen3_xml, seed_oss, openai (gpt-oss)")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM compatibility: pagellm never logs requests' "
                        "contents, either way")
    s.add_argument("--headless", action="store_true",
                   help="run only this node's data-parallel engine cores (ranks from "
                        "--data-parallel-start-rank, --data-parallel-size-local of them) "
                        "and attach them to the frontend at --data-parallel-address:"
                        "--data-parallel-rpc-port; no API server")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served by name (needs --enable-lora): name=path, or "
                        'JSON {"name": ..., "path": ..., "base_model_name": ...}; a '
                        "request's model field picks one")
    s.add_argument("--enable-dev-endpoints", action="store_true",
                   help="add the RL control routes: /sleep, /wake_up, /pause, /resume, "
                        "/collective_rpc, the weight-update phases, ... (behind --api-key)")
    p.set_defaults(func=_serve)


def _serve(ns: argparse.Namespace) -> int:
    if ns.headless:
        from pagellm.frontend.engine_client.dp_node import run_dp_node
        from pagellm.transport.curve import CurveClientKeys

        return run_dp_node(EngineArgs.from_cli_args(ns), CurveClientKeys.from_paths(
            ns.curve_secret_key, ns.curve_server_public_key))
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"pagellm serve needs the 'serve' extra ({e.name} is missing): "
                         "pip install -e '.[serve]'") from None
    from pagellm.frontend.server.serve import run_server

    check_server_flags(ns)
    args = EngineArgs.from_cli_args(ns)
    chat_template = None if ns.chat_template is None else load_chat_template(ns.chat_template)
    if chat_template is not None and args.skip_tokenizer_init:
        raise ValueError("--chat-template needs a tokenizer (not --skip-tokenizer-init)")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    lora_modules = tuple(parse_lora_modules(ns.lora_modules))
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    options = ServerOptions(served_model_name=ns.served_model_name or args.model,
                            lora_modules=lora_modules,
                            allow_runtime_lora_updating=runtime_updates_from_env(os.environ),
                            chat_template=chat_template,
                            api_key=ns.api_key, max_body_bytes=ns.max_body_size,
                            trust_request_chat_template=ns.trust_request_chat_template,
                            enable_dev_endpoints=ns.enable_dev_endpoints,
                            max_response_entries=ns.max_response_entries,
                            engine_stall_timeout_s=ns.engine_stall_timeout,
                            enable_auto_tool_choice=ns.enable_auto_tool_choice,
                            tool_call_parser=ns.tool_call_parser)
    return run_server(args, options, ns.host, ns.port, ns.engine_address,
                      ns.curve_secret_key, ns.curve_server_public_key, ns.shutdown_timeout,
                      ns.max_connections, ns.max_connections_per_client)


MIN_BODY_BYTES = 1024  # below this even a short completion request cannot arrive


def check_server_flags(ns: argparse.Namespace) -> None:
    """The server's own flags, each named when out of range (the engine's are
    EngineArgs'): a port beyond 65535 would wrap around to another (70000 is 4464), an
    empty API key would admit "Bearer " and nothing else, an infinite shutdown timeout
    would crash the server after the engine started."""
    check_int("--port", ns.port, minimum=0, maximum=65535)
    check_float("--shutdown-timeout", ns.shutdown_timeout, minimum=0,
                maximum=MAX_SHUTDOWN_TIMEOUT_S)
    check_int("--max-body-size", ns.max_body_size, minimum=MIN_BODY_BYTES)
    check_int("--max-connections", ns.max_connections, minimum=1, allow_none=True)
    check_int("--max-connections-per-client", ns.max_connections_per_client, minimum=1,
              allow_none=True)
    check_int("--max-response-entries", ns.max_response_entries, minimum=1,
              maximum=INT64_MAX)
    check_float("--engine-stall-timeout", ns.engine_stall_timeout, minimum=0.0,
                min_exclusive=True, maximum=MAX_SHUTDOWN_TIMEOUT_S)
    if ns.api_key is not None and not ns.api_key.strip():
        raise ValueError("--api-key must not be empty (leave the flag out for no key)")


def load_chat_template(value: str) -> str:
    """vLLM's reading of --chat-template: a file's contents if `value` names one, else
    the template itself; a value with no template syntax that names no file is a typo'd
    path, refused rather than rendered as a constant prompt."""
    try:
        if Path(value).is_file():
            return Path(value).read_text()
    except OSError:  # e.g. longer than a path may be: not a file name, then
        pass
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja "
                         "template")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with errors on one line: the generate and serve usages run to dozens
    of lines of engine options, which would bury the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagellm", description="pagellm: serve LLMs fast.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_make_model(sub)
    _add_serve(sub)
    sub.add_parser("engine-core", add_help=False,
                   help="run a standalone engine core (see `pagellm engine-core --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine-core"]:
        from pagellm.enginecore.__main__ import main as engine_core_main

        return engine_core_main(argv[1:], prog="pagellm engine-core")
    configure_logging()
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns))
    except (ValueError, TypeError, FileNotFoundError, ConnectionError, TimeoutError,
            PermissionError) as e:  # bad input, or an engine address nothing answers at
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not isinstance(e, KeyError) and not _from_model_library(e):
            raise
        # transformers' own checks of a model's config or tokenizer files (KeyError,
        # huggingface_hub's StrictDataclassError...): one line, like ours.
        text = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
        print(f"pagellm: error: {type(e).__name__}: {text}", file=sys.stderr)
        return 2


def _from_model_library(error: BaseException) -> bool:
    """Whether `error` is one of the model libraries' own exception types."""
    module = type(error).__module__.split(".")[0]
    return module in ("transformers", "huggingface_hub", "tokenizers", "safetensors")


if __name__ == "__main__":
    sys.exit(main())
