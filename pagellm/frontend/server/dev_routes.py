"""The RL control routes (`pagellm serve --enable-dev-endpoints`), in vLLM's shapes:

    POST /sleep?level=1&mode=abort      {"status": "sleeping", "level": 1}
    POST /wake_up?tags=weights&tags=..  {"status": "awake" | "sleeping", "tags": [...] | null}
    GET  /is_sleeping                   {"is_sleeping": bool}
    POST /pause?mode=abort              {"status": "paused"}
    POST /resume                        {"status": "resumed"}
    GET  /is_paused                     {"is_paused": bool}
    POST /reset_prefix_cache?reset_running_requests=false&reset_external=false
                                        {"success": bool} (vLLM >= 0.26's answer)
    GET  /get_world_size?include_dp=true {"world_size": tp x dp} (workers; tp without dp)
    POST /collective_rpc                {"method", "args", "kwargs", "timeout"} -> {"results"}
    POST /init_weight_transfer_engine   {"init_info": {...}}
    POST /start_weight_update
    POST /update_weights                {"update_info": {"names", "dtype_names", "shapes"}}
    POST /finish_weight_update          {"weight_version": str} (optional)
    GET  /server_info?config_format=text|json  {"vllm_config": str | {...}}: the resolved
         configuration under vLLM's names (server_info.py), which trainers read first

They drive the whole engine, so they exist only when asked for (vLLM hides them behind
a dev mode too) and sit behind the API key like every other route. A call the engine
refuses (a bad value, the wrong state) is a 400 naming why; a collective_rpc past its
timeout a 504.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, get_args

import msgspec
from fastapi import FastAPI, Query, Request

from pagellm.frontend.async_llm import AsyncLLM
from pagellm.frontend.engine_client.core_client import EngineDeadError
from pagellm.frontend.server.edge import APIError, bad_request
from pagellm.frontend.server.server_info import CONFIG_FORMATS, vllm_config, vllm_config_text
from pagellm.protocol.utility import SleepLevel

T = TypeVar("T")
BodyOf = Callable[[Request, type[Any]], Awaitable[Any]]


class CollectiveRpcRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


class InitRequest(msgspec.Struct, forbid_unknown_fields=True):
    init_info: dict[str, Any]


class UpdateRequest(msgspec.Struct, forbid_unknown_fields=True):
    update_info: dict[str, Any]


class FinishRequest(msgspec.Struct, forbid_unknown_fields=True):
    weight_version: str | None = None


# The routes that take nothing: (HTTP method, path, the engine's call, its answer).
PLAIN_ROUTES: tuple[tuple[str, str, Callable[[AsyncLLM], Awaitable[Any]],
                          Callable[[Any], dict[str, Any]]], ...] = (
    ("GET", "/is_sleeping", AsyncLLM.is_sleeping, lambda asleep: {"is_sleeping": asleep}),
    ("POST", "/resume", AsyncLLM.resume_generation, lambda _: {"status": "resumed"}),
    ("GET", "/is_paused", AsyncLLM.is_paused, lambda paused: {"is_paused": paused}),
    ("POST", "/start_weight_update", AsyncLLM.start_weight_update,
     lambda _: {"message": "Weight update started"}),
)
SLEEP_LEVELS = [str(level) for level in get_args(SleepLevel)]  # as the query spells them
# A query flag as vLLM's FastAPI/pydantic `bool` reads it (any case), so a client written
# for vLLM (requests sends Python's "True") is read alike; anything else is a 400 here
# rather than pydantic's 422 in FastAPI's shape, which OpenAI-shaped clients cannot parse.
FLAG_SPELLINGS = {**dict.fromkeys(("true", "1", "yes", "on", "t", "y"), True),
                  **dict.fromkeys(("false", "0", "no", "off", "f", "n"), False)}


def add_dev_routes(app: FastAPI, engine: AsyncLLM, body_of: BodyOf,
                   served_model_name: str | None = None) -> None:
    """`body_of(request, type)`: the server's bounded, typed reading of a JSON body;
    `served_model_name`: the name /server_info reports (default: the model's)."""
    for method, path, call, answer in PLAIN_ROUTES:
        app.add_api_route(path, _plain_route(engine, call, answer), methods=[method],
                          name=path.removeprefix("/"))
    _add_sleep_routes(app, engine)
    _add_cache_routes(app, engine)
    _add_weight_routes(app, engine, body_of)
    _add_server_info_route(app, engine, served_model_name)


async def _control(call: Awaitable[T]) -> T:
    """An engine call, its refusal (a bad value, the wrong state) a 400, a timeout a 504."""
    try:
        return await call
    except EngineDeadError:
        raise
    except TimeoutError as e:
        raise APIError(504, str(e), "TimeoutError") from None
    except (RuntimeError, ValueError) as e:
        raise bad_request(str(e)) from None


def _plain_route(engine: AsyncLLM, call: Callable[[AsyncLLM], Awaitable[Any]],
                 answer: Callable[[Any], dict[str, Any]]
                 ) -> Callable[[], Awaitable[dict[str, Any]]]:
    async def route() -> dict[str, Any]:
        return answer(await _control(call(engine)))
    return route


def _add_sleep_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.post("/sleep")
    async def sleep(level: str = "1", mode: str = "abort") -> dict[str, Any]:
        if level not in SLEEP_LEVELS:  # before int(): "99999999999999999999999", "٣"
            raise bad_request(f"level must be {', '.join(SLEEP_LEVELS[:-1])} or "
                              f"{SLEEP_LEVELS[-1]}, got {level[:20]!r}")
        await _control(engine.sleep(int(level), mode))
        return {"status": "sleeping", "level": int(level)}

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> dict[str, Any]:  # noqa: B008
        awake = await _control(engine.wake_up(tags))
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, str]:
        await _control(engine.pause_generation(mode))
        return {"status": "paused"}


def _flag(name: str, value: str) -> bool:
    """A boolean query parameter, read as vLLM reads it; a bad value is a 400 naming
    the parameter (a typo'd "ture" must not silently mean false)."""
    parsed = FLAG_SPELLINGS.get(value.lower()) if len(value) <= 5 else None
    if parsed is None:
        raise APIError(400, f"{name} must be true or false, got {value[:20]!r}",
                       "BadRequestError", name)
    return parsed


def _add_cache_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: str = "false",
                                 reset_external: str = "false") -> dict[str, bool]:
        """vLLM's route: `reset_external` is its name for the KV connector's cache
        (`reset_connector` in the engine API). The answer is vLLM's {"success": bool}
        (TRL's client reads the status; a refusal while requests hold KV blocks is a
        200 with false, as in vLLM, not an error)."""
        running = _flag("reset_running_requests", reset_running_requests)
        external = _flag("reset_external", reset_external)
        success = await _control(engine.reset_prefix_cache(
            reset_running_requests=running, reset_connector=external))
        return {"success": success}


def _add_weight_routes(app: FastAPI, engine: AsyncLLM, body_of: BodyOf) -> None:
    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, int]:
        """vLLM's figure: every worker process (tensor-parallel ranks times engine
        cores), or one core's with include_dp=false: what a trainer sizes its
        weight-transfer group by (world_size = 1 + this)."""
        info = engine.info
        return {"world_size": info.world_size * (info.data_parallel_size if include_dp else 1)}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, Any]:
        body = await body_of(request, CollectiveRpcRequest)
        results = await _control(engine.collective_rpc(body.method, body.timeout,
                                                       tuple(body.args), body.kwargs))
        return {"results": [_jsonable(r) for r in results]}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict[str, str]:
        body = await body_of(request, InitRequest)
        await _control(engine.init_weight_transfer_engine({"init_info": body.init_info}))
        return {"message": "Weight transfer initialized"}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, str]:
        body = await body_of(request, UpdateRequest)
        await _control(engine.update_weights({"update_info": body.update_info}))
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict[str, str]:
        body = await body_of(request, FinishRequest) \
            if int(request.headers.get("content-length") or 0) else FinishRequest()
        await _control(engine.finish_weight_update(body.weight_version))
        return {"message": "Weight update finished"}


def _add_server_info_route(app: FastAPI, engine: AsyncLLM,
                           served_model_name: str | None) -> None:
    @app.get("/server_info")
    async def server_info(config_format: str = "text") -> dict[str, Any]:
        """vLLM's default is "text" (its one-line summary); trainers ask for "json"."""
        if config_format not in CONFIG_FORMATS:
            raise bad_request(f"config_format must be {' or '.join(CONFIG_FORMATS)}, got "
                              f"{config_format[:20]!r}")
        config = vllm_config(engine.engine_args, engine.info,
                             served_model_name or engine.info.model)
        return {"vllm_config": config if config_format == "json"
                else vllm_config_text(config)}


def _jsonable(value: Any) -> Any:
    """A collective_rpc result as JSON: tensors become nested lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value
