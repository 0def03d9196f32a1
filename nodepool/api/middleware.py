"""Request plumbing that runs before any view: request ids and the request body ceiling."""

from __future__ import annotations

import io
import re
import uuid

from django.conf import settings

from .problems import problem_response

_SAFE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class RequestIdMiddleware:
    """Request ids: accepted from ``X-Request-ID`` (bounded) or generated, and echoed back."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        supplied = request.META.get("HTTP_X_REQUEST_ID", "")
        request.request_id = supplied if _SAFE.match(supplied) else uuid.uuid4().hex
        response = self.get_response(request)
        response["X-Request-ID"] = request.request_id
        return response


def _too_large(limit: int, detail: str):
    response = problem_response(413, "payload_too_large", f"{detail} The limit is {limit} bytes.", limit=limit)
    # The rest of the body is not read; do not let the client reuse a connection in that state.
    response["Connection"] = "close"
    return response


class BodyLimitMiddleware:
    """Refuse request bodies above ``NODEPOOL_MAX_BODY_BYTES`` with 413, declared or not.

    A declared ``Content-Length`` above the limit is refused before a byte is read. A chunked
    body (``Transfer-Encoding: chunked``, no ``Content-Length``) is read up to the limit here:
    Django's WSGI request treats a body without ``Content-Length`` as empty, so without this an
    agent that streams its JSON would see its request silently parsed as ``{}``. Views can only
    tighten the limit further (``max_body_bytes`` on the view, checked by the JSON parser).
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = settings.NODEPOOL_MAX_BODY_BYTES
        declared = request.META.get("CONTENT_LENGTH") or ""
        if declared:
            if not declared.isdigit():
                return problem_response(400, "invalid_content_length", "Content-Length must be a number of bytes.")
            if int(declared) > limit:
                return _too_large(limit, f"The request body is {int(declared)} bytes.")
        elif "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
            body = _read_at_most(request.META.get("wsgi.input"), limit + 1)
            if len(body) > limit:
                return _too_large(limit, "The chunked request body exceeds the limit.")
            # Hand the de-chunked body to Django as if it had been declared.
            request._stream = io.BytesIO(body)
            request.META["CONTENT_LENGTH"] = str(len(body))
        return self.get_response(request)


def _read_at_most(stream, size: int) -> bytes:
    if stream is None:
        return b""
    parts, remaining = [], size
    while remaining > 0:
        chunk = stream.read(min(remaining, 64 * 1024))
        if not chunk:
            break
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)
