"""The HTTP routes; each handler is thin and finds shared state on ``request.app.state.server``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from alignedserve import __version__
from alignedserve.entrypoints.engine_client import engine_alive
from alignedserve.entrypoints.openai_errors import APIError, server_error
from alignedserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from alignedserve.entrypoints.serving_chat import create_chat_completion
from alignedserve.entrypoints.serving_completions import create_completion

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
    if not engine_alive(state.engine):
        raise server_error("the engine has stopped", status=503)
    if state.lifecycle.draining:
        raise server_error("the server is shutting down", status=503)
    return Response(status_code=200)


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": __version__, "kernel_path": _state(request).info.kernel_path})


async def list_models(request: Request) -> JSONResponse:
    names = _state(request).settings.model_names
    return JSONResponse(ModelList(data=[_card(request, n) for n in names]).model_dump())


async def get_model(request: Request, model_id: str) -> JSONResponse:
    return JSONResponse(_card(request, _model_name(request, model_id)).model_dump())


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    model = _model_name(request, body.model)
    return await create_completion(state.client, state.info, model, body, request)


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    model = _model_name(request, body.model)
    return await create_chat_completion(state.client, state.info, model, body, request)


def api_router() -> APIRouter:
    router = APIRouter()
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
