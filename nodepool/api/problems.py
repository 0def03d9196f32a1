"""RFC 9457 problem details for every API error.

Every error response is ``application/problem+json`` with ``type``, ``title``, ``status``,
``detail`` and a stable machine-readable ``code``; validation errors add ``errors``, a list of
``{"field": "a.b", "code": ..., "message": ...}``. Services raise :class:`Problem` (or one of its
subclasses) and the views never build error bodies by hand. Every code is declared once, with its
status and title, in :mod:`nodepool.api.errors` or its app's ``errors`` module; a code declared as
a deprecated name of another is answered as the new ``code`` plus ``deprecated_code``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.db import DataError, IntegrityError, InterfaceError, OperationalError
from django.http import Http404, JsonResponse
from django_fsm import ConcurrentTransition, TransitionNotAllowed
from rest_framework import exceptions, status
from rest_framework.response import Response

from nodepool.db_deadline import timed_out as past_deadline

from . import errors

logger = logging.getLogger(__name__)

PROBLEM_CONTENT_TYPE = "application/problem+json"
TYPE_BASE = "https://nodepool.dev/problems/"


class Problem(exceptions.APIException):
    """An API error with a stable ``code``.

    Args:
        detail: human-readable explanation of this occurrence.
        code: a declared :class:`~nodepool.api.errors.ErrorCode`; defaults to the class's ``default_code``.
        status_code: HTTP status; defaults to the code's declared status (tests check the two agree).
        extra: additional members merged into the problem body (e.g. ``reasons``).
    """

    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "The request could not be processed."
    default_code = errors.BAD_REQUEST

    def __init__(
        self, detail: str | None = None, code: str | None = None, *, status_code: int | None = None, **extra: Any
    ):
        code = code or self.default_code
        # A subclass (Conflict, Gone…) names its status: it must be the code's declared one.
        expected = status_code if status_code is not None else None if type(self) is Problem else self.status_code
        declared = errors.resolve(code, expected)
        super().__init__(detail or self.default_detail, declared or code)
        if status_code is not None:
            self.status_code = status_code
        elif declared is not None:
            self.status_code = declared.status
        self.extra = extra


class Conflict(Problem):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state of the resource."
    default_code = errors.CONFLICT


class Gone(Problem):
    status_code = status.HTTP_410_GONE
    default_detail = "The resource is gone."
    default_code = errors.GONE


class PreconditionFailed(Problem):
    status_code = status.HTTP_412_PRECONDITION_FAILED
    default_detail = "The resource has changed since you read it."
    default_code = errors.VERSION_MISMATCH


class PreconditionRequired(Problem):
    status_code = status.HTTP_428_PRECONDITION_REQUIRED
    default_detail = "This action needs the expected version: send If-Match or expected_version."
    default_code = errors.VERSION_REQUIRED


class PayloadTooLarge(Problem):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = errors.PAYLOAD_TOO_LARGE


class TooManyRequests(Problem):
    """429 with ``Retry-After`` (seconds) and a ``retry_after`` member."""

    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_detail = "Too many requests; retry later."
    default_code = errors.THROTTLED

    def __init__(self, detail: str | None = None, code: str | None = None, *, retry_after: int, **extra: Any):
        super().__init__(detail, code, retry_after=int(retry_after), **extra)
        self.wait = int(retry_after)


class ServiceUnavailable(Problem):
    """503 with ``Retry-After``: a dependency (the database) is down or too slow; retry later."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "A dependency of the service is unavailable; retry later."
    default_code = errors.SERVICE_UNAVAILABLE

    def __init__(self, detail: str | None = None, code: str | None = None, *, retry_after: int = 5, **extra: Any):
        super().__init__(detail, code, retry_after=int(retry_after), **extra)
        self.wait = int(retry_after)


class Unprocessable(Problem):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "The request is well-formed but cannot be processed."
    default_code = errors.UNPROCESSABLE


class Forbidden(Problem):
    status_code = status.HTTP_403_FORBIDDEN
    default_detail = "You do not have permission to perform this action."
    default_code = errors.FORBIDDEN


class NotFound(Problem):
    status_code = status.HTTP_404_NOT_FOUND
    default_detail = "Not found."
    default_code = errors.NOT_FOUND


_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    409: "Conflict",
    410: "Gone",
    304: "Not Modified",
    412: "Precondition Failed",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    428: "Precondition Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

# Stable codes for DRF's own exceptions.
_DRF_CODES = {
    exceptions.ParseError: errors.MALFORMED_BODY,
    exceptions.AuthenticationFailed: errors.AUTHENTICATION_FAILED,
    exceptions.NotAuthenticated: errors.NOT_AUTHENTICATED,
    exceptions.PermissionDenied: errors.FORBIDDEN,
    exceptions.NotFound: errors.NOT_FOUND,
    exceptions.MethodNotAllowed: errors.METHOD_NOT_ALLOWED,
    exceptions.NotAcceptable: errors.NOT_ACCEPTABLE,
    exceptions.UnsupportedMediaType: errors.UNSUPPORTED_MEDIA_TYPE,
    exceptions.Throttled: errors.THROTTLED,
}


def problem_body(status_code: int, code: str, detail: str, **extra: Any) -> dict[str, Any]:
    """Build a problem+json body (a dict) with the members every nodepool error carries.

    ``code`` must be declared (:mod:`nodepool.api.errors`); the title is its declared one. A
    deprecated code is answered as its replacement, the old name in ``deprecated_code``."""
    declared = errors.resolve(code, status_code)
    wire = declared.wire if declared is not None else str(code)
    current = errors.lookup(wire)
    body = {
        "type": TYPE_BASE + wire.replace("_", "-"),
        "title": current.title if current is not None else _TITLES.get(status_code, "Error"),
        "status": status_code,
        "detail": detail,
        "code": wire,
    }
    if declared is not None and declared.replaced_by is not None:
        body["deprecated_code"] = str(declared)
    body.update(extra)
    return body


def _flatten_validation(detail: Any, prefix: str = "") -> list[dict[str, str]]:
    """Turn DRF's nested ``ValidationError.detail`` into a flat list of field errors."""
    out: list[dict[str, str]] = []
    if isinstance(detail, dict):
        for key, value in detail.items():
            # ListField errors are keyed by index; spell them like list items (items[1].tags[0]).
            name = f"{prefix}[{key}]" if isinstance(key, int) else f"{prefix}.{key}" if prefix else str(key)
            if key == "non_field_errors" and not prefix:
                name = ""
            out.extend(_flatten_validation(value, name))
    elif isinstance(detail, list):
        if all(isinstance(item, str) for item in detail):
            for item in detail:
                out.append({"field": prefix, "code": getattr(item, "code", "invalid"), "message": str(item)})
        else:
            for index, item in enumerate(detail):
                if item:
                    out.extend(_flatten_validation(item, f"{prefix}[{index}]" if prefix else f"[{index}]"))
    else:
        out.append({"field": prefix, "code": getattr(detail, "code", "invalid"), "message": str(detail)})
    return out


def exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF exception handler: every error becomes problem+json with a stable code."""
    headers: dict[str, str] = {}
    if isinstance(exc, Http404):
        exc = NotFound(str(exc) if str(exc) else None)
    elif isinstance(exc, DjangoPermissionDenied):
        exc = Forbidden()
    elif isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge()
    elif isinstance(exc, TransitionNotAllowed):
        exc = Conflict(str(exc), errors.TRANSITION_NOT_ALLOWED)
    elif isinstance(exc, ConcurrentTransition):
        exc = Conflict(
            "Another request changed this object at the same time; read it again.", errors.CONCURRENT_MODIFICATION
        )
    elif isinstance(exc, SuspiciousOperation):
        exc = Problem(str(exc) or "Suspicious request.", errors.SUSPICIOUS_REQUEST)
    elif isinstance(exc, RecursionError):
        exc = Unprocessable("The JSON document is nested too deeply.", errors.JSON_TOO_DEEP)
    elif isinstance(exc, DataError | OverflowError):
        # A number or string the serializer let through but the column cannot hold (PostgreSQL
        # DataError, SQLite OverflowError). The transaction was rolled back; nothing changed.
        logger.warning("value out of range for storage: %s", exc)
        exc = Problem("A value in the request is out of range for this field.", errors.VALUE_OUT_OF_RANGE)
    elif isinstance(exc, OperationalError | InterfaceError):
        # The database is down, unreachable, or cancelled a statement (statement_timeout: psycopg's
        # QueryCanceled is an OperationalError; so is SQLite's "database is locked"). Retryable.
        exc = database_unavailable(exc)
    elif isinstance(exc, IntegrityError):
        # A uniqueness or check constraint caught what validation did not (often a race between
        # two creates). The change was rolled back; the client may read and retry.
        logger.warning("integrity error turned into 409: %s", exc)
        exc = Conflict(
            "The request conflicts with stored data (a uniqueness or consistency rule).", errors.INTEGRITY_ERROR
        )

    if not isinstance(exc, exceptions.APIException):
        return None

    extra: dict[str, Any] = {}
    if isinstance(exc, Problem):
        code = exc.default_code if exc.detail is None else exc.get_codes()
        code = code if isinstance(code, str) else exc.default_code
        detail = str(exc.detail)
        extra = dict(exc.extra)
    elif isinstance(exc, exceptions.ValidationError):
        field_errors = _flatten_validation(exc.detail)
        code = errors.VALIDATION_ERROR
        fields = sorted({e["field"] for e in field_errors if e["field"]})
        detail = "Invalid input" + (
            f" in: {', '.join(fields)}." if fields else ": " + field_errors[0]["message"] if field_errors else "."
        )
        extra["errors"] = field_errors
    else:
        code = next((c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)), None)
        if code is None:
            raw = exc.get_codes()
            code = raw if isinstance(raw, str) else errors.ERROR
        detail = str(exc.detail)
        specific = exc.get_codes()
        if isinstance(exc, exceptions.AuthenticationFailed) and isinstance(specific, str) and specific != code:
            # The stable code stays authentication_failed; why (credential_revoked, _expired,
            # _superseded...) is a separate member an agent can act on (re-enroll, rotate sooner).
            extra["reason"] = specific
        if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
            extra["retry_after"] = int(exc.wait)
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    if getattr(exc, "wait", None):
        headers["Retry-After"] = str(int(exc.wait))
    status_code = exc.status_code
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed) and not headers.get(
        "WWW-Authenticate"
    ):
        # DRF turns 401 into 403 when no authenticator offers a challenge; we always offer Token.
        headers["WWW-Authenticate"] = 'Token realm="api"'
        status_code = 401
    body = problem_body(status_code, code, detail, **extra)
    request = context.get("request")
    if request is not None and getattr(request, "request_id", None):
        body["request_id"] = request.request_id
    response = Response(body, status=status_code, headers=headers, content_type=PROBLEM_CONTENT_TYPE)
    return response


DATABASE_RETRY_AFTER = 5


def database_unavailable(exc: Exception) -> ServiceUnavailable:
    """The 503 for a database error that a retry may cure; the driver's message goes to the log only."""
    logger.warning("database unavailable, answering 503: %s: %s", type(exc).__name__, exc)
    message = str(exc)
    # The server cancelled the statement (statement_timeout), the connect timeout expired, or the
    # request's deadline cut a connection the server never answered on (nodepool.db_deadline).
    timed_out = (
        "statement timeout" in message
        or "canceling statement" in message
        or "timeout expired" in message
        or past_deadline()
    )
    return ServiceUnavailable(
        "The database did not answer in time; retry later."
        if timed_out
        else "The database is unavailable; retry later.",
        errors.DATABASE_TIMEOUT if timed_out else errors.DATABASE_UNAVAILABLE,
        retry_after=DATABASE_RETRY_AFTER,
    )


def database_unavailable_response(exc: Exception) -> JsonResponse:
    """:func:`database_unavailable` as a plain Django response (outside DRF views)."""
    problem = database_unavailable(exc)
    response = problem_response(503, problem.get_codes(), str(problem.detail), **problem.extra)
    response["Retry-After"] = str(problem.wait)
    return response


def problem_response(status_code: int, code: str, detail: str, **extra: Any) -> JsonResponse:
    """A plain Django problem+json response, for errors raised outside DRF views."""
    return JsonResponse(
        problem_body(status_code, code, detail, **extra), status=status_code, content_type=PROBLEM_CONTENT_TYPE
    )


def handler404(request, exception=None):
    return problem_response(404, errors.NOT_FOUND, "No resource at this address.")


def handler400(request, exception=None):
    if isinstance(exception, RequestDataTooBig):
        return problem_response(413, errors.PAYLOAD_TOO_LARGE, "The request body is too large.")
    return problem_response(400, errors.BAD_REQUEST, "The request could not be processed.")


def handler403(request, exception=None):
    return problem_response(403, errors.FORBIDDEN, "You do not have permission to perform this action.")


def handler500(request):
    logger.error("unhandled error on %s", request.path)
    return problem_response(500, errors.INTERNAL_ERROR, "The server failed to process the request.")
