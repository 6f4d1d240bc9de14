"""vLLM's runtime adapter endpoints: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`, answered as vLLM answers them (200 with a plain-text line);
and tokenfleet's `POST /v1/pin_lora_adapter {"lora_name", "seconds"}`: keep a known adapter loaded (loading
it first) and never evict it for another one until the pin ends — the operator renews pins on the pods it
chose to hold a deployment's minimum copies of an adapter (operator/adapter_copies.py).

Loading reads and checks the adapter off the event loop (file reads); a bad adapter is a 400 naming the
problem, a taken name a 400, a full host cache whose adapters are all in use a 503 with Retry-After, and an
unknown name on unload a 404 `model_not_found` — in every case nothing changes. Loading reads files from the
pod's disk, so with an internal key configured only it opens these paths (access.py): the operator and
the routers drive them, not tenants.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from tokenfleet.runtime.openai.translate import parse_request
from tokenfleet.runtime.server.errors import ApiError
from tokenfleet.runtime.server.state import STATE_KEY, HttpError

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
PIN_PATH = "/v1/pin_lora_adapter"
PATHS = frozenset({LOAD_PATH, UNLOAD_PATH, PIN_PATH})
MAX_PIN_SECONDS = 600.0  # a lease, renewed by whoever wants it kept: never a pin nobody renews for long


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's `load_inplace` and the like: accepted, unused

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class PinLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    seconds: float = Field(gt=0, le=MAX_PIN_SECONDS)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's `lora_int_id`

    lora_name: str = Field(min_length=1)


def _manager(request: web.Request):
    state = request.app[STATE_KEY]
    state.require_engine()
    manager = state.lora
    if manager is None:
        raise HttpError(
            ApiError(
                404,
                "LoRA adapters are off on this server: start it with --enable-lora (lora.enable: true).",
                type="not_found_error",
                code="lora_disabled",
            )
        )
    return manager


async def load_endpoint(request: web.Request) -> web.Response:
    manager = _manager(request)
    body = parse_request(LoadLoRAAdapterRequest, await request.read())
    await asyncio.to_thread(manager.register, body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_endpoint(request: web.Request) -> web.Response:
    manager = _manager(request)
    body = parse_request(UnloadLoRAAdapterRequest, await request.read())
    manager.unregister(body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def pin_endpoint(request: web.Request) -> web.Response:
    manager = _manager(request)
    body = parse_request(PinLoRAAdapterRequest, await request.read())
    await asyncio.to_thread(manager.pin, body.lora_name, body.seconds)
    return web.json_response({"lora_name": body.lora_name, "pinned_seconds": body.seconds})


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post(LOAD_PATH, load_endpoint)
    app.router.add_post(UNLOAD_PATH, unload_endpoint)
    app.router.add_post(PIN_PATH, pin_endpoint)
