"""OpenAI-shaped errors: one exception type, one body shape, handlers for every failure FastAPI can raise.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with the status
OpenAI would use, so SDKs raise their typed exceptions (``BadRequestError``, ``NotFoundError``...); on
``/v1/messages`` as Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (``error_response``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger(__name__)

# Seconds a client should wait before retrying a request refused because the queue is full.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error to return to the client as-is (status + OpenAI error body + optional headers)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


# Anthropic's error types by status (``/v1/messages``); other statuses: api_error (5xx), invalid_request_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error",
}  # fmt: skip


def anthropic_error(err: APIError) -> tuple[int, dict[str, Any]]:
    """``err`` as Anthropic sends it: its status (a full queue is 529, Anthropic's "overloaded") and
    ``{"type": "error", "error": {"type", "message"}}``; the field, if any, leads the message."""
    status = 529 if err.code == "queue_full" else err.status_code
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = err.message if err.param is None or err.param in err.message else f"{err.param}: {err.message}"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: APIError, path: str) -> JSONResponse:
    """The response for ``err`` on ``path``: Anthropic's shape on /v1/messages, Ollama's ``{"error": ...}``
    on /api/*, OpenAI's elsewhere."""
    if path.startswith("/api/"):
        return JSONResponse({"error": err.message}, status_code=err.status_code, headers=err.headers)
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        status, body = anthropic_error(err)
        return JSONResponse(body, status_code=status, headers=err.headers)
    return err.response()


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response (for the OpenAPI schema; errors are built by ``APIError``)."""

    error: ErrorBody


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error on ``/v1/messages`` (Anthropic's shape; built by ``anthropic_error``)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorBody


_ERROR_DESCRIPTIONS = {
    400: "Invalid request: a malformed body, a field out of range, an unsupported parameter, a prompt too long",
    401: "Missing or wrong API key (with --api-key only)",
    404: "No such model (or, for /v1/responses/{id}, no such stored response)",
    413: "The request body is larger than --max-request-bytes",
    429: "Every loaded LoRA adapter is in use by unfinished requests (--max-cpu-loras; see Retry-After)",
    500: "Internal error",
    503: "Overloaded (queue full; see Retry-After), shutting down, or the engine has stopped",
    529: "Overloaded: the queue is full (see Retry-After); /v1/messages only, where other routes answer 503",
}


def error_responses(*codes: int, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route for the OpenAPI schema: each status it can return, with its body
    (Anthropic's on the ``/v1/messages`` routes)."""
    model = AnthropicErrorResponse if anthropic else ErrorResponse
    return {c: {"model": model, "description": _ERROR_DESCRIPTIONS[c]} for c in codes}


def document_validation_as_400(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with a body or parameters; here validation errors leave
    as 400 in the OpenAI shape (``install_error_handlers``), so the schema drops the 422s. Error bodies
    are documented as JSON on every route (FastAPI would give a text route's errors its text type)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    # An error body is JSON even where the route's own response is text (LoRA loading).
                    for response in responses.values():
                        content = response.get("content", {})
                        text = content.get("text/plain", {})
                        if text.get("schema", {}).get("$ref", "").endswith("/ErrorResponse"):
                            content["application/json"] = content.pop("text/plain")
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def required_field(obj: Any, name: str, where: str) -> Any:
    """``obj.name``, or the 400 that names ``where.name`` as missing (an input item of a surface that
    reads several item types through one model, each requiring other fields)."""
    value = getattr(obj, name)
    if value is None:
        raise bad_request(f"Missing required parameter: '{where}.{name}'.", param=f"{where}.{name}")
    return value


def unsupported(param: str, what: str | None = None) -> APIError:
    """A field that would change the meaning of the request and that we do not implement."""
    return APIError(
        400, what or f"'{param}' is not supported by this server", param=param, code="unsupported_parameter"
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
        param=None,
        code="invalid_api_key",
    )


def payload_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server accepts ({limit} bytes; see --max-request-bytes).",
        code="request_too_large",
    )


def request_timeout(seconds: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {seconds:g} s of its head (see --body-timeout).",
        code="request_timeout",
    )


def queue_full(limit: int) -> APIError:
    return APIError(
        503,
        f"The server is overloaded: more than {limit} requests are waiting. Retry later.",
        type="server_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def lora_limit_reached(message: str, param: str) -> APIError:
    """Every loaded LoRA adapter is in use (``--max-cpu-loras``): a 429, as it passes when requests finish."""
    return APIError(
        429,
        message,
        type="rate_limit_error",
        param=param,
        code="lora_limit_reached",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, type="server_error", code=code)


def internal_error(message: str = "The server had an error while processing your request.") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


# Pydantic names the branch of a union it tried in the error location ("str", "list[int]",
# "TextPart"...); those are not fields and must not appear in ``param``.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_type_tag(p: str) -> bool:
    return p in _TYPE_TAGS or "[" in p or (p[:1].isupper() and p.isidentifier())


def loc_to_param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"`` (OpenAI names params this way)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and _is_type_tag(p):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or None


def _validation_message(err: dict[str, Any], param: str | None) -> str:
    kind = err.get("type", "")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request: " + str(err.get("ctx", {}).get("error", err["msg"]))
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if kind == "missing":
        return f"Missing required parameter: '{param}'."
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Value error, "):  # our own validators: the message is already complete
        return msg[len("Value error, ") :]
    return f"Invalid value for '{param}': {msg}" if param else msg


def validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(_validation_message(first, None), code="invalid_json")
    ctx = first.get("ctx") or {}
    if "param" in ctx:  # a validator of the whole body, which knows the field (limits.RequestBody)
        return bad_request(_validation_message(first, ctx["param"]), param=ctx["param"])
    param = loc_to_param(first.get("loc", ()))
    if param is None:  # the body itself: empty, or not an object
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    if any(_is_type_tag(str(x)) for x in first.get("loc", ())):
        # Every branch of a union failed. The one branch whose type the value had (its errors are no type
        # mismatches) says what is wrong, a list too long say; otherwise say so once, not per branch.
        inside = [e for e in errors if _within(loc_to_param(e.get("loc", ())), param)]
        typed = [e for e in inside if not str(e.get("type", "")).endswith("_type")]
        if len(typed) == 1:
            first = typed[0]
            param = loc_to_param(first.get("loc", ())) or param
        elif len(inside) > 1:
            return bad_request(f"Invalid type for '{param}': it matches none of the accepted forms.", param=param)
    return bad_request(_validation_message(first, param), param=param)


def _within(param: str | None, field: str) -> bool:
    return param is not None and (param == field or param.startswith((f"{field}.", f"{field}[")))


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the path's error shape (never FastAPI's default 422/``detail`` body)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"Invalid URL ({request.method} {request.url.path})"
            err = APIError(404, msg, code="not_found")
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed for {request.url.path}"
            err = APIError(405, msg, code="method_not_allowed")
        else:
            err = APIError(
                exc.status_code,
                str(exc.detail),
                type="invalid_request_error" if exc.status_code < 500 else "server_error",
            )
        resp = error_response(err, request.url.path)
        for k, v in (getattr(exc, "headers", None) or {}).items():
            resp.headers[k] = v
        if exc.status_code == 405:
            # Starlette names the methods of the first route on the path; a path with a route per
            # method (GET and DELETE /v1/responses/{id}) allows all of theirs.
            allowed = {
                m
                for route in request.app.router.routes
                if route.matches(request.scope)[0] != Match.NONE
                for m in getattr(route, "methods", None) or ()
            }
            if allowed:
                resp.headers["Allow"] = ", ".join(sorted(allowed))
        return resp

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, _exc: Exception) -> JSONResponse:
        # Starlette re-raises after sending this, so uvicorn logs the traceback once.
        return error_response(internal_error(), request.url.path)
