"""Optimistic concurrency for operator actions: ``version``, ``ETag`` and ``If-Match``.

Every mutable resource has an integer ``version`` that each change increments. ``GET`` answers
with ``ETag: "<version>"``; an operator action must say which version it acts on, either with
``If-Match: "<version>"`` or with an ``expected_version`` member in the JSON body.

Rule (RFC 9110 §13.1.1 and RFC 6585 §3): a stale version gets 412, a missing one 428.
"""

from __future__ import annotations

import re

from django.db import router, transaction
from django.db.transaction import TransactionManagementError

from .problems import NotFound, PreconditionFailed, PreconditionRequired, Problem

# A strong or weak ETag ("3", W/"3"); a bare 3 is tolerated for hand-written curl commands.
_ETAG = re.compile(r'^\s*(?:W/)?(?:"(\d{1,18})"|(\d{1,18}))\s*$')


def etag_for(version: int) -> str:
    """The ETag header value for ``version`` (a strong validator: ``"7"``)."""
    return f'"{version}"'


def expected_version(request) -> int:
    """The version the client expects, from ``If-Match`` or the body's ``expected_version``.

    Raises:
        PreconditionRequired: neither was sent (428, ``version_required``).
        Problem: malformed value (400, ``invalid_version``); a body the parser refuses (400).
    """
    # Parse the body first even when If-Match answers: an action whose view never reads the body
    # must still refuse one the parser refuses (NaN, NUL, not JSON) instead of acting on it.
    data = getattr(request, "data", None)
    header = request.headers.get("If-Match")
    if header is not None:
        if header.strip() == "*":
            raise Problem("If-Match: * is not accepted here; send the version you read.", "invalid_version")
        match = _ETAG.match(header)
        if not match:
            raise Problem(f"If-Match must be an ETag such as '\"3\"', not {header!r}.", "invalid_version")
        return int(match.group(1) or match.group(2))
    value = data.get("expected_version") if isinstance(data, dict) else None
    if value is None:
        raise PreconditionRequired()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Problem("expected_version must be a non-negative integer.", "invalid_version")
    return value


def check_version(current: int, expected: int) -> None:
    """Raise 412 ``version_mismatch`` unless ``expected`` equals ``current``."""
    if current != expected:
        raise PreconditionFailed(
            f"You acted on version {expected} but the resource is at version {current}; read it again.",
            current_version=current,
        )


class ETagMixin:
    """DRF view mixin: add ``ETag`` to responses that carry a single object with a ``version``."""

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        data = getattr(response, "data", None)
        if 200 <= response.status_code < 300 and isinstance(data, dict) and isinstance(data.get("version"), int):
            response["ETag"] = etag_for(data["version"])
        return response


def lock_for_action(queryset, *, expected: int, **lookup):
    """Lock the one row of ``queryset`` matching ``lookup`` and check its version.

    Call inside ``transaction.atomic()``: on PostgreSQL the row stays locked (``SELECT ... FOR
    UPDATE``) until the transaction ends, and on SQLite the IMMEDIATE transaction already holds
    the database write lock, so of two requests acting on the same version exactly one passes.
    The caller then changes the object, increments ``version`` and saves.

    Args:
        queryset: a queryset or manager of a model with an integer ``version`` field.
        expected: the version the client read (from :func:`expected_version`).
        **lookup: filter that identifies the row, e.g. ``pk=...``.

    Raises:
        NotFound: no such row (404, ``not_found``).
        PreconditionFailed: the row is at another version (412, ``version_mismatch``).
        TransactionManagementError: called outside a transaction.
    """
    queryset = queryset.all()
    if not transaction.get_connection(router.db_for_write(queryset.model)).in_atomic_block:
        raise TransactionManagementError("lock_for_action() must run inside transaction.atomic()")
    obj = queryset.select_for_update().filter(**lookup).first()
    if obj is None:
        raise NotFound(f"No {queryset.model._meta.verbose_name} matches the given query.")
    check_version(obj.version, expected)
    return obj
