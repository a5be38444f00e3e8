"""OpenAI-style error answers: ``{"error": {"message", "type", "param", "code"}}`` (DESIGN rule 9).

Schema problems are split by kind: a value of the wrong type or a missing field is 422
(``UnprocessableEntityError`` in the openai client); a well-typed but invalid value (out of
range, unknown role, unsupported option) is 400; malformed JSON or non-UTF-8 bytes are 400.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
         422: "UnprocessableEntityError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

# pydantic error kinds that mean "wrong type / shape" rather than "bad value"
_TYPE_ERRORS = {"missing", "int_type", "int_parsing", "int_from_float", "float_type", "float_parsing", "string_type",
                "bool_type", "bool_parsing", "list_type", "dict_type", "model_type", "model_attributes_type",
                "union_tag_invalid", "none_required", "tuple_type", "bytes_type"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": TYPES.get(status, "APIError"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _loc(err: dict) -> str:
    parts = [str(p) for p in err.get("loc", ()) if p != "body"]
    return ".".join(parts)


async def validation_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "the request body is not valid JSON (or not UTF-8): "
                                   f"{errors[0].get('ctx', {}).get('error', errors[0].get('msg'))}")
    status = 422 if all(e.get("type") in _TYPE_ERRORS for e in errors) else 400
    if status == 400:
        errors = [e for e in errors if e.get("type") not in _TYPE_ERRORS] or errors
    first = errors[0]
    messages = "; ".join(f"{_loc(e) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return error_response(status, messages, _loc(first) or None)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def http_error_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and "parsing the body" in str(exc.detail):      # e.g. bytes that are not UTF-8
        return error_response(400, "the request body is not valid JSON (or not UTF-8); send a UTF-8 JSON object")
    return error_response(exc.status_code, str(exc.detail))


async def unexpected_handler(_: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
