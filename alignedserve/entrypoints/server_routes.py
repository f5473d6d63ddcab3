"""The HTTP routes; each handler is thin and finds shared state on ``request.app.state.server``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncio
import functools
import json
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from alignedserve import __version__
from alignedserve.entrypoints.openai_errors import APIError, bad_request, server_error
from alignedserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from alignedserve.entrypoints.serving_chat import create_chat_completion
from alignedserve.entrypoints.serving_completions import create_completion
from alignedserve.kernels.isa import cpu_info

if TYPE_CHECKING:
    from alignedserve.entrypoints.server_state import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _model_name(request: Request, requested: str | None) -> str:
    """The canonical name to answer with; 404 for a model this server does not serve."""
    names = _state(request).settings.model_names
    if requested is None:
        return names[0]
    if requested not in names:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in names)}", param="model",
                       code="model_not_found")
    return requested


def _card(request: Request, name: str) -> ModelCard:
    state = _state(request)
    return ModelCard(id=name, root=state.settings.model_names[0],
                     max_model_len=state.info.max_model_len)


async def health(request: Request) -> Response:
    state = _state(request)
    if not state.engine.is_running:
        raise server_error("the engine has stopped", status=503)
    if state.lifecycle.draining:
        raise server_error("the server is shutting down", status=503)
    return Response(status_code=200)


async def version(request: Request) -> JSONResponse:
    """Our version, the engine's kernel path and this machine's CPU (``alignedserve bench``
    records them with each run against a server, which may be another machine)."""
    return JSONResponse({"version": __version__, "kernel_path": _state(request).info.kernel_path,
                         "cpu": cpu_info().summary()})


async def list_models(request: Request) -> JSONResponse:
    names = _state(request).settings.model_names
    return JSONResponse(ModelList(data=[_card(request, n) for n in names]).model_dump())


async def get_model(request: Request, model_id: str) -> JSONResponse:
    return JSONResponse(_card(request, _model_name(request, model_id)).model_dump())


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _snapshot(request: Request) -> dict:
    state = _state(request)
    return state.engine.snapshot(state.settings.model_names[0], state.latencies)


async def engine_state(request: Request) -> JSONResponse:
    return JSONResponse(_snapshot(request))


async def engine_events(request: Request) -> StreamingResponse:
    """One snapshot as an SSE ``data:`` event every ``interval`` seconds (default 1, 0.1-60)
    until the client goes away or the server drains."""
    try:
        interval = float(request.query_params.get("interval", "1"))
    except ValueError:
        interval = float("nan")
    if not 0.1 <= interval <= 60:
        raise bad_request("interval must be a number of seconds in [0.1, 60]",
                          param="interval")
    lifecycle = _state(request).lifecycle

    async def events():
        while not lifecycle.draining and not await request.is_disconnected():
            yield f"data: {json.dumps(_snapshot(request))}\n\n"
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@functools.cache
def _console_html() -> str:
    return (resources.files("alignedserve.entrypoints") / "console.html").read_text()


async def console_page(request: Request) -> HTMLResponse:
    """The web console (one self-contained file shipped in the package)."""
    return HTMLResponse(_console_html())


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    model = _model_name(request, body.model)
    return await create_completion(state.client, state.info, model, body, request)


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    model = _model_name(request, body.model)
    return await create_chat_completion(state.client, state.info, model, body, request)


def api_router(ui: bool = True) -> APIRouter:
    """Every route; ``ui`` adds the web console at ``/``."""
    router = APIRouter()
    if ui:
        router.add_api_route("/", console_page, methods=["GET"], response_model=None,
                             include_in_schema=False)
    router.add_api_route("/engine/state", engine_state, methods=["GET"], response_model=None)
    router.add_api_route("/engine/events", engine_events, methods=["GET"], response_model=None)
    router.add_api_route("/health", health, methods=["GET"], response_model=None)
    router.add_api_route("/version", version, methods=["GET"], response_model=None)
    router.add_api_route("/v1/models", list_models, methods=["GET"], response_model=None)
    router.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"],
                         response_model=None)
    router.add_api_route("/metrics", metrics, methods=["GET"], response_model=None)
    router.add_api_route("/v1/completions", completions, methods=["POST"], response_model=None)
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                         response_model=None)
    return router
