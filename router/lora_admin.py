"""vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: LoRA adapters loaded and
unloaded at run time on every engine instance, with ``--allow-runtime-lora-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); behind the API keys, and over the authenticated control sockets.

The router sends each live instance a ``LoRAUpdate`` and waits for every answer. An engine loads an
adapter into a free slot of its ``--max-loras`` (it refuses one that is not built, by name), or unloads one
no request of its own still has. Each instance lists its adapters in its registry entry, which is how
every router process learns them: a request names a loaded adapter as its model and goes only to
instances that serve it (``router.dispatcher``). A load answers once the registry shows the adapter on
every instance that loaded it. An instance that failed is named in the error; those that loaded the
adapter keep it (requests go there). A name already loaded is refused, as vLLM refuses it.

The cluster keeps each adapter loaded at run time in Redis (``common.registry.RuntimeAdapters``, signed under
the cluster key): written before the engines are asked to load it (and deleted again where none could), deleted
before they are asked to unload it. An engine that starts later, restarted after a crash or added, loads the
adapters kept there with its ``--lora-modules``, and every engine unloads one it loaded from there once it is
gone from there (``common.service``): a restart loses no adapter, and an engine the router missed converges.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict, Field, StrictStr

from common.protocol import MAX_ID_LEN, LoRAUpdate
from common.registry import InstanceInfo
from router.errors import APIError, bad_request
from router.openai_models import CheckedRequest, parse_request
from router.state import RouterState

logger = logging.getLogger(__name__)

UPDATE_TIMEOUT_S = 120.0  # an engine loads between steps: a long step, then the adapter's files
REGISTRY_WAIT_S = 10.0


class LoadLoRAAdapterRequest(CheckedRequest):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1, max_length=MAX_ID_LEN)
    lora_path: StrictStr = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(CheckedRequest):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1, max_length=MAX_ID_LEN)
    lora_int_id: int | None = None  # vLLM's; adapters here are named only


async def _update_all(state: RouterState, name: str, path: str | None) -> tuple[list[InstanceInfo], dict[str, str]]:
    """Send the update to every live instance; those that did it, and the error of each that did not."""
    instances = [*state.pool.alive("prefill"), *state.pool.alive("decode")]
    if not instances:
        raise APIError(503, "no engine instance is available", code="no_instances")
    client = state.dispatcher.client
    ids = {info.instance_id: f"lora-{uuid.uuid4().hex}" for info in instances}
    queues = {instance: client.open(rid) for instance, rid in ids.items()}
    errors: dict[str, str] = {}
    try:
        for info in instances:
            update = LoRAUpdate(request_id=ids[info.instance_id], reply_to=client.reply_address, lora_name=name,
                                lora_path=path)
            if not await client.send(info.control_address, update):
                errors[info.instance_id] = "unreachable"
        waits = {instance: asyncio.ensure_future(queue.get()) for instance, queue in queues.items()
                 if instance not in errors}
        if waits:
            await asyncio.wait(waits.values(), timeout=UPDATE_TIMEOUT_S)
        for instance, wait in waits.items():
            if not wait.done():
                wait.cancel()
                errors[instance] = f"no answer within {UPDATE_TIMEOUT_S:.0f} s"
            elif wait.result().finish_reason != "stop":
                errors[instance] = wait.result().error or "failed"
    finally:
        for rid in ids.values():
            client.discard(rid)
    return [info for info in instances if info.instance_id not in errors], errors


def _failure(action: str, name: str, done: list[InstanceInfo], errors: dict[str, str]) -> APIError:
    detail = "; ".join(f"{instance}: {error}" for instance, error in sorted(errors.items()))
    where = f" (done on {', '.join(i.instance_id for i in done)})" if done else ""
    return APIError(400, f"{action} LoRA adapter '{name}' failed on {len(errors)} instance(s){where}: {detail}",
                    param="lora_name", code="lora_update_failed")


async def _registry_shows(state: RouterState, instances: list[InstanceInfo], name: str, loaded: bool) -> None:
    """Wait (a bounded while) until the registry lists the adapter on each of ``instances`` (or no longer)."""
    wanted = {info.instance_id for info in instances}
    deadline = time.monotonic() + REGISTRY_WAIT_S
    while time.monotonic() < deadline:
        entries = {i.instance_id: i for role in ("prefill", "decode") for i in state.pool.alive(role)}
        if all((name in entries[i].lora_names) == loaded for i in wanted if i in entries):
            return
        await asyncio.sleep(0.05)


async def _keep(state: RouterState, name: str, path: str | None) -> None:
    """Keep the adapter for engines that start later (``path`` None: forget it); a warning where Redis is down."""
    adapters = state.runtime_adapters
    if adapters is None:
        return
    ok = await asyncio.to_thread(adapters.remove, name) if path is None else await asyncio.to_thread(
        adapters.put, name, path)
    if not ok:
        logger.warning("redis unreachable: LoRA adapter %r %s the cluster's runtime adapters (an engine that starts "
                       "later will %s it)", name, "left in" if path is None else "not kept in",
                       "still load" if path is None else "not load")


async def load_adapter(state: RouterState, body: Any) -> str:
    request = parse_request(LoadLoRAAdapterRequest, body, state.config.limits)
    name = request.lora_name
    if name in state.config.served_model_names:
        raise bad_request(f"'{name}' is the served model's name", param="lora_name")
    if state.lora_name(name) is not None:
        raise bad_request(f"the LoRA adapter '{name}' has already been loaded", param="lora_name")
    await _keep(state, name, request.lora_path)
    try:
        done, errors = await _update_all(state, name, request.lora_path)
    except APIError:  # no instance to load it: not to be loaded by engines that start later either
        await _keep(state, name, None)
        raise
    if not done:  # loaded nowhere: the same
        await _keep(state, name, None)
    if errors:
        raise _failure("loading", name, done, errors)
    await _registry_shows(state, done, name, loaded=True)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(state: RouterState, body: Any) -> str:
    request = parse_request(UnloadLoRAAdapterRequest, body, state.config.limits)
    name = request.lora_name
    if state.lora_name(name) is None:
        raise APIError(404, f"the LoRA adapter '{name}' is not loaded", param="lora_name", code="model_not_found")
    await _keep(state, name, None)
    done, errors = await _update_all(state, name, None)
    if errors:
        raise _failure("unloading", name, done, errors)
    await _registry_shows(state, done, name, loaded=False)
    return f"Success: LoRA adapter '{name}' removed successfully."


def install_lora_admin_routes(app: FastAPI, state: RouterState) -> None:
    """Adds the two routes (only with ``--allow-runtime-lora-updating``)."""
    from router.app import read_json  # here: router.app imports this module to call this function

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_route(request: Request) -> PlainTextResponse:
        state.api_keys.check(request.headers.get("authorization"))
        body = await read_json(request, state.config.max_body_bytes)
        return PlainTextResponse(await load_adapter(state, body))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_route(request: Request) -> PlainTextResponse:
        state.api_keys.check(request.headers.get("authorization"))
        body = await read_json(request, state.config.max_body_bytes)
        return PlainTextResponse(await unload_adapter(state, body))
