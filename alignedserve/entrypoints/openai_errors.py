"""OpenAI-style error objects, and the handlers that turn every failure into one.

Every non-2xx answer of the server has the body ``{"error": {"message", "type", "param",
"code"}}``, including FastAPI's own validation failures (which would otherwise be 422s with a
``detail`` list) and Starlette's 404/405s. Types follow OpenAI: ``invalid_request_error`` for
the client's mistakes, ``server_error`` for ours, ``overloaded_error`` for back-pressure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from alignedserve.entrypoints.openai_protocol import ErrorInfo, ErrorResponse

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"
# Pydantic labels union members in error locations ("prompt", "list[int]", 3); they are not
# field names, so they must not appear in ``param``.
_TYPE_TAG_CHARS = "[]-"
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after"}


class APIError(Exception):
    """An error with a definite HTTP status; raised anywhere in a handler, answered as-is."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | int | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(503, message, type=OVERLOADED, code="overloaded",
                    headers={"Retry-After": str(retry_after_s)})


def server_error(message: str, status: int = 500) -> APIError:
    return APIError(status, message, type=SERVER_ERROR)


def error_json(status: int, message: str, type: str = INVALID_REQUEST,
               code: str | int | None = None, headers: Mapping[str, str] | None = None
               ) -> JSONResponse:
    """For code outside handlers (middleware) that answers directly."""
    return APIError(status, message, type=type, code=code, headers=headers).response()


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in _TYPE_TAG_CHARS))


def _param_of(loc: tuple[Any, ...]) -> str | None:
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and not _is_type_tag(part):
            path += f".{part}" if path else part
    return path or None


def _union_root(loc: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The location of the union a failed branch belongs to (None: not a union branch)."""
    for i, part in enumerate(loc):
        if _is_type_tag(part):
            return loc[:i]
    return None


def _describe_union(branches: list[dict[str, Any]]) -> str:
    # Every branch failed; the one that got deepest into the value is the most telling.
    best = max(branches, key=lambda e: len(e.get("loc", ())))
    root = _union_root(tuple(best["loc"])) or ()
    tags = []
    for e in branches:
        tag = tuple(e["loc"])[len(root)].replace("constrained-", "")
        if tag not in tags:
            tags.append(tag)
    where = _param_of(tuple(best["loc"])) or "body"
    return f"{where}: {best.get('msg', 'invalid value')} (expected {' or '.join(tags)})"


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem, stated plainly; the count of the others."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return bad_request(f"malformed JSON body: {detail} (at byte {first['loc'][-1]})")
    loc = tuple(first.get("loc", ()))
    if loc == ("body",) and first.get("type") == "missing":
        return bad_request("a JSON request body is required")
    root = _union_root(loc)
    branches = [e for e in errors if root is not None and _union_root(tuple(e["loc"])) == root]
    param = _param_of(root if root is not None else loc)
    if len(branches) > 1:
        message = _describe_union(branches)
    else:
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"{_param_of(loc)}: {message}" if _param_of(loc) else message
    others = len({_param_of(_union_root(tuple(e["loc"])) or tuple(e["loc"])) for e in errors}) - 1
    if others > 0:
        message += f" (and problems with {others} other field{'s' if others > 1 else ''})"
    return bad_request(message, param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        return error_json(exc.status_code, str(exc.detail), kind, headers=exc.headers)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_json(500, f"internal server error: {type(exc).__name__}", SERVER_ERROR)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
