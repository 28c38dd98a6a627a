"""Errors as OpenAI returns them: an HTTP status and {"error": {message, type, param, code}}."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

# gRPC status -> HTTP status. A prompt that can never fit (RESOURCE_EXHAUSTED) is the caller's
# mistake, as OpenAI treats a context-length overflow.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "internal_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def from_exception(exc: BaseException) -> OpenAIError:
    """A gRPC failure (or the client's error carrying its status code) as an OpenAIError."""
    if isinstance(exc, OpenAIError):
        return exc
    code = getattr(exc, "code", None)
    code = code() if callable(code) else code
    if isinstance(code, grpc.StatusCode):
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        return OpenAIError(_HTTP_STATUS.get(code, 500), details or code.name)
    if isinstance(exc, (ValueError, TypeError)):
        return OpenAIError(400, str(exc))
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}")
