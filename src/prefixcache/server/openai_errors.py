"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, for every answer on the OpenAI-compatible
paths: the routes' own errors and the middleware's refusals (401 without a key, 413 for a body over the limit)
alike, so the official client raises its typed errors (``AuthenticationError``, ...) on each. Every other path
answers ``{"detail": ...}``."""

from __future__ import annotations

OPENAI_PATHS = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions"})


def openai_error(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error body for ``status``."""
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_exceeded"}.get(status)
    kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
    code = "model_not_found" if status == 404 else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(path: str, status: int, message: str) -> dict:
    """The body of a refusal on ``path``: OpenAI's shape on :data:`OPENAI_PATHS`, else ``{"detail": message}``."""
    return openai_error(message, status) if path.rstrip("/") in OPENAI_PATHS else {"detail": message}
