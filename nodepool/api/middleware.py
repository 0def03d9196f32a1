"""Request plumbing that runs before any view: request ids, header and body ceilings, and the
guarantee that every error under ``/api/`` and the probes is ``application/problem+json``."""

from __future__ import annotations

import io
import logging
import re
import uuid

from django.conf import settings
from django.db import InterfaceError, OperationalError

from nodepool.api.errors import (
    HEADER_TOO_LARGE,
    HEADERS_TOO_LARGE,
    INVALID_CONTENT_LENGTH,
    INVALID_HEADER_VALUE,
    PAYLOAD_TOO_LARGE,
)

from .problems import PROBLEM_CONTENT_TYPE, database_unavailable_response, problem_response

logger = logging.getLogger(__name__)
PROBLEM_PATHS = ("/api/", "/healthz", "/readyz")

_SAFE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# Control bytes RFC 9110 (5.5) forbids in a field value (TAB is allowed): the class gunicorn and
# the shipped nginx configuration (deploy/nginx) refuse too, with the same answer as here.
_CONTROL_BYTES = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class RequestIdMiddleware:
    """Request ids: accepted from ``X-Request-ID`` (bounded) or generated, and echoed back."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        supplied = request.META.get("HTTP_X_REQUEST_ID", "")
        request.request_id = supplied if _SAFE.fullmatch(supplied) else uuid.uuid4().hex
        response = self.get_response(request)
        response["X-Request-ID"] = request.request_id
        return response


def _too_large(limit: int, detail: str):
    # No `Connection: close` although the rest of the body is not read: WSGI forbids hop-by-hop
    # headers (PEP 3333; wsgiref, under runserver and the live test server, turns one into a 500),
    # gunicorn drops it anyway and itself discards an unread body before the next request.
    return problem_response(413, PAYLOAD_TOO_LARGE, f"{detail} The limit is {limit} bytes.", limit=limit)


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
            # ASCII only: a latin-1 header byte 0xB2 arrives as "²", which isdigit() accepts and int() refuses.
            if not (declared.isascii() and declared.isdigit()):
                return problem_response(400, INVALID_CONTENT_LENGTH, "Content-Length must be a number of bytes.")
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


class HeaderLimitMiddleware:
    """431 problem+json for a request header above ``NODEPOOL_MAX_HEADER_BYTES`` (8 KiB), or for all
    headers together above ``NODEPOOL_MAX_HEADERS_TOTAL_BYTES`` (32 KiB) — RFC 6585 §5; 400
    ``invalid_header_value`` for a control byte (``\\x00``–``\\x1f`` but TAB, and DEL) in a value.

    gunicorn refuses larger ones itself, before the application sees them, with its own plain-text
    page: ``gunicorn.conf.py`` sets its per-header limit (``limit_request_field_size``) to twice ours
    so that the common case gets this answer (docs/foundation.md, "Request limits").
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit, total_limit, total = settings.NODEPOOL_MAX_HEADER_BYTES, settings.NODEPOOL_MAX_HEADERS_TOTAL_BYTES, 0
        for key, value in request.META.items():
            if not key.startswith("HTTP_") or not isinstance(value, str):
                continue
            size = len(key) + len(value)
            total += size
            if _CONTROL_BYTES.search(value):
                name = key[5:].replace("_", "-").title()
                return problem_response(
                    400,
                    INVALID_HEADER_VALUE,
                    f"The {name} header holds a control character; header values may not.",
                    header=name,
                )
            if size > limit:
                name = key[5:].replace("_", "-").title()
                return problem_response(
                    431,
                    HEADER_TOO_LARGE,
                    f"The {name} header is {len(value)} bytes; the limit is {limit} bytes per header.",
                    header=name,
                    limit=limit,
                )
        if total > total_limit:
            return problem_response(
                431,
                HEADERS_TOO_LARGE,
                f"The request headers total {total} bytes; the limit is {total_limit} bytes.",
                limit=total_limit,
            )
        return self.get_response(request)


class ProblemJsonMiddleware:
    """Errors under ``/api/`` and the probes are problem+json whatever produced them or the ``Accept``.

    DRF views already answer problem+json (nodepool.api.problems); this covers the rest: Django's
    own 405 of a plain view, and a database that is down or too slow outside DRF (503 with
    ``Retry-After``). The admin's and the browsable API's own HTML pages are not under these paths.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if response.status_code < 400 or not request.path.startswith(PROBLEM_PATHS):
            return response
        content_type = (response.get("Content-Type") or "").split(";")[0].strip()
        if content_type in (PROBLEM_CONTENT_TYPE, "application/json"):
            return response
        problem = problem_response(
            response.status_code,
            "method_not_allowed" if response.status_code == 405 else "error",
            "Method not allowed." if response.status_code == 405 else "The request could not be processed.",
        )
        for header in ("Allow", "Retry-After", "WWW-Authenticate"):
            if response.has_header(header):
                problem[header] = response[header]
        return problem

    def process_exception(self, request, exception):
        if isinstance(exception, OperationalError | InterfaceError):
            return database_unavailable_response(exception)
        return None
