"""Errors in OpenAI's JSON shape, and the handlers that guarantee every failure uses it.

Every error body is ``{"error": {"message", "type", "param", "code"}}``, except on
Anthropic's Messages API (``/v1/messages``), whose clients read Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (``anthropic_body``). Clients (the
official SDKs included) dispatch on the HTTP status, so statuses are chosen with care:
400 bad input, 401 bad key, 404 unknown model or route, 413 body too large, 503
overloaded / loading / shutting down, 500 only for our own bugs (never with a traceback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error that maps 1:1 onto an OpenAI error response."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        """The error's response to a request for ``path`` (its shape: Anthropic's there)."""
        return error_response(path, self.status, self.body(), self.headers)


# Anthropic's Messages API answers in Anthropic's error shape, its types by status.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(path: str, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """``body`` (OpenAI's shape) as the response to a request for ``path``: in Anthropic's
    shape on its Messages API (under any root path)."""
    if path.rstrip("/").endswith(ANTHROPIC_PATHS):
        body = anthropic_body(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def overloaded(message: str, code: str = "server_overloaded") -> APIError:
    # Retry-After tells well-behaved clients (the OpenAI SDK honours it) when to retry.
    return APIError(503, message, SERVER_ERROR, None, code, headers={"Retry-After": "1"})


# SamplingParams messages start with the field name ("temperature must be >= 0.0, ...");
# the first word becomes `param` when it is one of these request fields.
_PARAM_NAMES = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
    "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
    "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "length_penalty",
    # structured output (kvloom/structured/openai.py): "response_format.json_schema.schema ..."
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_json_object", "structured_outputs",
})


def from_value_error(error: ValueError, param: str | None = None) -> APIError:
    """A ValueError from SamplingParams, the structured-output fields or the engine, as a
    400 naming the field (the engine's rejections carry ``param`` and ``code``; the
    others' messages start with the field's name, or its dotted path)."""
    message = str(error)
    param = param or getattr(error, "param", None)
    if param is None:  # "top_p must be ...", "response_format.json_schema: ..."
        first = message.split(" ", 1)[0].split("(", 1)[0].rstrip(":")
        param = first if first.split(".", 1)[0] in _PARAM_NAMES else None
    return bad_request(message, param, getattr(error, "code", None) or "invalid_value")


def format_loc(loc: Sequence[int | str]) -> str | None:
    """Pydantic's ``("body", "messages", 0, "content")`` -> ``"messages[0].content"``.

    Union branches (``"str"``, ``"list[int]"``, ...) are pydantic's bookkeeping, not
    request fields, and are dropped."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(item, int):
            if not parts:
                continue  # the JSON decoder's character position, not a field
            parts[-1] += f"[{item}]"
        elif "[" in item or item in ("str", "int", "float", "bool", "function-after"):
            continue
        else:
            parts.append(item)
    return ".".join(parts) or None


def validation_error(errors: Sequence[Any]) -> APIError:
    """The first pydantic/FastAPI validation error as an OpenAI-style 400."""
    if not errors:
        return bad_request("invalid request")
    error = errors[0]
    kind = error.get("type", "")
    loc = error.get("loc", ())
    param = format_loc(loc)
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "invalid JSON")
        return bad_request(f"request body is not valid JSON: {detail}")
    if kind == "extra_forbidden":
        return bad_request(f"unsupported parameter {param!r}: kvloom does not implement it "
                           "(see docs/api.md for the supported parameters)", param,
                           "unsupported_parameter")
    if kind in ("model_attributes_type", "dict_type") and param is None:
        return bad_request("request body must be a JSON object (Content-Type: application/json)")
    if kind == "missing":
        if param is None:
            return bad_request("request body is required (a JSON object)")
        return bad_request(f"missing required parameter {param!r}", param)
    message = str(error.get("msg", "invalid value"))
    # pydantic prefixes messages of ValueErrors raised in validators; ours are complete.
    message = message.removeprefix("Value error, ")
    if param and param.split("[")[0].split(".")[0] not in message:
        message = f"{param}: {message}"
    return bad_request(message, param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape; no tracebacks leave the server."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            error.status_code)
        kind = SERVER_ERROR if error.status_code >= 500 else INVALID_REQUEST
        detail = error.detail if isinstance(error.detail, str) else str(error.detail)
        if error.status_code == 404 and detail == "Not Found":
            detail = f"no route for {request.method} {request.url.path}"
        elif error.status_code == 400 and detail == "There was an error parsing the body":
            # FastAPI's words for a body json.loads could not even start on (JSON syntax
            # errors are RequestValidationErrors, with their position, above).
            detail = ("request body could not be read as JSON: it must be UTF-8 text, not "
                      "compressed (no Content-Encoding), nested fewer than about 1,000 levels deep")
        return error_response(request.url.path, error.status_code, error_body(detail, kind, None, code),
                              getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception) -> JSONResponse:
        # A bug of ours: log the traceback here, send the client a plain message.
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(request.url.path, 500, error_body("internal server error", SERVER_ERROR, None,
                                                                "internal_error"))
