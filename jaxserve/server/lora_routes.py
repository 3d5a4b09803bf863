"""Loading and unloading LoRA adapters while serving (--enable-lora): vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, and SGLang's /load_lora_adapter and
/unload_lora_adapter. The engine loads the adapter between two steps (jaxserve.engine.lora_slots:
it takes a slot when its requests come, or at once when pinned); the server's model names then
list it, so requests may name it.

The routes read any adapter directory the server process can, so they are off unless the server
was started with --enable-lora (as vLLM keeps them behind VLLM_ALLOW_RUNTIME_LORA_UPDATING);
--api-key guards them like every route.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import pydantic
from quart import Quart, Response, jsonify, request

from jaxserve.server.accepted_fields import KnownFields
from jaxserve.server.errors import ApiError, to_api_error
from jaxserve.server.generation import ServerState, route
from jaxserve.server.model_names import GENERIC_NAMES


class LoadLoraRequest(KnownFields):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name
    # SGLang's: the adapter takes an adapter slot now and keeps it until unloaded, never giving
    # it up to the adapters taking turns in the others (jaxserve.engine.lora_slots).
    pinned: bool = False


class UnloadLoraRequest(KnownFields):
    lora_name: str
    # vLLM's numeric id, optional there too: a name identifies one loaded adapter, so the id adds
    # nothing to honour.
    lora_int_id: int | None = None


def _check_enabled(state: ServerState) -> None:
    if not state.runtime_lora:
        raise ApiError(400, "loading LoRA adapters while serving is off: start the server with --enable-lora "
                       "(adapters given by --lora-modules are loaded at start-up)", "lora_name")


def _check_name(state: ServerState, name: str) -> None:
    if not name.strip() or name != name.strip():
        raise ApiError(400, f"lora_name: a non-empty name without surrounding spaces, got {name!r}", "lora_name")
    if name in state.model_names.names or name in GENERIC_NAMES:
        raise ApiError(400, f"lora_name: {name!r} is a name of the served model", "lora_name")


def _set_adapters(state: ServerState, adapters: tuple[tuple[str, str, str | None], ...]) -> None:
    # A new ModelNames, swapped in on the event loop: a route reading the old one finishes with it.
    state.model_names = dataclasses.replace(state.model_names, adapters=adapters)


async def _load(state: ServerState) -> str:
    _check_enabled(state)
    req = LoadLoraRequest.model_validate_json(await request.get_data(cache=False))
    _check_name(state, req.lora_name)
    name = req.lora_name
    try:
        await state.engine.load_lora(name, req.lora_path, replace=req.load_inplace, pinned=req.pinned)
    except ValueError as e:  # LoraRefused names its parameter; the adapter's files are the path's
        raise ApiError(400, str(e), getattr(e, "param", "lora_path")) from None
    except OSError as e:  # a directory the server may not read
        raise ApiError(400, f"lora_path: {req.lora_path} cannot be read ({e.strerror or e})", "lora_path") from None
    others = tuple(a for a in state.model_names.adapters if a[0] != name)
    _set_adapters(state, (*others, (name, req.lora_path, None)))
    return name


async def _unload_name(state: ServerState, name: str) -> None:
    if name not in state.model_names.adapter_names:  # vLLM's: a name it cannot find is a 404
        loaded = ", ".join(state.model_names.adapter_names) or "none"
        raise ApiError(404, f"lora_name: no LoRA adapter named {name!r} is loaded (loaded: {loaded})", "lora_name")
    try:
        await state.engine.unload_lora(name)
    except ValueError as e:
        raise ApiError(400, str(e), "lora_name") from None
    _set_adapters(state, tuple(a for a in state.model_names.adapters if a[0] != name))


async def _unload(state: ServerState) -> str:
    _check_enabled(state)
    req = UnloadLoraRequest.model_validate_json(await request.get_data(cache=False))
    await _unload_name(state, req.lora_name)
    return req.lora_name


async def vllm_load(state: ServerState) -> Response:
    """vLLM's: load the PEFT adapter at lora_path as the model lora_name."""
    name = await _load(state)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", status=200, content_type="text/plain")


async def vllm_unload(state: ServerState) -> Response:
    """vLLM's: unload the adapter lora_name (refused while a request decodes with it)."""
    name = await _unload(state)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", status=200, content_type="text/plain")


def _sglang_body(state: ServerState, error: str = "") -> dict:
    return {"success": not error, "error_message": error,
            "loaded_adapters": {name: path for name, path, _ in state.model_names.adapters}}


async def _sglang(state: ServerState, action: Callable[[ServerState], Awaitable[str]]) -> Response:
    """SGLang's shape for the result, errors included: {success, error_message, loaded_adapters}."""
    try:
        await action(state)
    except (ApiError, pydantic.ValidationError) as e:
        error = to_api_error(e)
        assert error is not None
        return jsonify(_sglang_body(state, error.message)), error.status
    return jsonify(_sglang_body(state))


async def sglang_load(state: ServerState) -> Response:
    """SGLang's: load the PEFT adapter at lora_path as lora_name; the loaded adapters come back."""
    return await _sglang(state, _load)


async def sglang_unload(state: ServerState) -> Response:
    """SGLang's: unload lora_name; the adapters still loaded come back."""
    return await _sglang(state, _unload)


def register(app: Quart, state: ServerState) -> None:
    route(app, state, "/v1/load_lora_adapter", vllm_load, "POST", LoadLoraRequest)
    route(app, state, "/v1/unload_lora_adapter", vllm_unload, "POST", UnloadLoraRequest)
    route(app, state, "/load_lora_adapter", sglang_load, "POST", LoadLoraRequest)
    route(app, state, "/unload_lora_adapter", sglang_unload, "POST", UnloadLoraRequest)
