"""OpenAI-shaped error bodies and the exception handlers that produce them.

Every error the server returns looks like
`{"error": {"message": ..., "type": ..., "param": ..., "code": <http status>}}`
(vLLM's shape: `type` is the error class name a client library would raise).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from threefold.errors import ThreefoldError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    422: "UnprocessableEntityError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ServerError(ThreefoldError):
    """A failure the server itself decides on (auth, overload, shutdown, a failed request)."""

    def __init__(self, message: str, status_code: int, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message, param=param, status_code=status_code)
        self.retry_after_s = retry_after_s


class ClientDisconnected(Exception):
    """The client went away before its response was ready (nobody reads the answer)."""


def error_body(message: str, status_code: int, param: str | None = None) -> dict:
    error_type = _ERROR_TYPES.get(status_code) or HTTPStatus(status_code).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(message: str, status_code: int, param: str | None = None,
                   retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(message, status_code, param), status_code=status_code, headers=headers)


def error_response_bytes(message: str, status_code: int, param: str | None = None) -> bytes:
    """The same body, pre-encoded, for the raw ASGI middleware."""
    return json.dumps(error_body(message, status_code, param)).encode()


def sse_error(error: ThreefoldError | Exception) -> str:
    """An error as a server-sent event; the openai client raises it as an APIError."""
    if isinstance(error, ThreefoldError):
        body = error_body(error.message, error.status_code, error.param)
    else:
        body = error_body(f"Internal error: {error!r}", 500)
    return f"data: {json.dumps(body)}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's first complaint, with the offending field named the way the client sent it."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return f"Malformed JSON in the request body: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return f"The request body must be a JSON object: {first.get('msg')}.", None
    # Unions report the branch tried (e.g. "prompt.str"); the client only knows the field.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return f"Invalid value for '{where}': {first.get('msg')}.", param


def install_handlers(app: FastAPI) -> None:
    """Map every exception a handler can raise to an OpenAI-shaped response."""

    @app.exception_handler(ThreefoldError)
    async def _threefold(_: Request, exc: ThreefoldError) -> JSONResponse:
        return error_response(exc.message, exc.status_code, exc.param, getattr(exc, "retry_after_s", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> JSONResponse:
        return error_response("Client disconnected.", 499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # A bug while serving one request must not take the server down: log it, answer 500.
        logger.error("request failed", exc_info=exc)
        return error_response(f"Internal error: {exc!r}", 500)
