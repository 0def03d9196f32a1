"""Optimistic concurrency for operator actions: ``version``, ``ETag`` and ``If-Match``.

Every mutable resource has an integer ``version`` that each change increments. ``GET`` answers
with ``ETag: "<version>.<digest>"`` (:func:`etag_for`); an operator action must say which version it
acts on, either with ``If-Match`` (that ETag, or ``"<version>"``) or with an ``expected_version``
member in the JSON body.

Rule (RFC 9110 §13.1.1 and RFC 6585 §3): a stale version gets 412, a missing one 428.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from django.db import router, transaction
from django.db.transaction import TransactionManagementError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.utils.encoders import JSONEncoder

from nodepool.api.errors import INVALID_IF_MATCH, INVALID_VERSION, VERSION_REQUIRED

from .problems import NotFound, PreconditionFailed, PreconditionRequired, Problem

# RFC 9110 §8.8.3: entity-tag = [ "W/" ] DQUOTE *etagc DQUOTE, etagc = %x21 / %x23-7E / obs-text.
# A comma may sit inside a tag, so lists are tokenised, not split on commas.
_ENTITY_TAG = re.compile(r'[ \t]*(W/)?"([\x21\x23-\x7e\x80-\xff]*)"[ \t]*')
_LIST_SEPARATOR = re.compile(r"[ \t]*,[ \t]*")


class ExpectedVersion(int):
    """The version an operator action may act on, from ``If-Match`` or ``expected_version``.

    It is an ``int`` (the first version listed, for messages and events) and carries every
    version the client listed in ``versions``: an ``If-Match`` list matches when any member does
    (RFC 9110 §13.1.1). Weak tags never match (strong comparison), so they are not in ``versions``.
    """

    versions: frozenset[int]

    def __new__(cls, versions: list[int], shown: int | None = None):
        obj = super().__new__(cls, shown if shown is not None else (versions[0] if versions else -1))
        obj.versions = frozenset(versions)
        return obj


def parse_entity_tags(header: str) -> list[tuple[bool, str]] | None:
    """``[(weak, opaque), ...]`` of an ``If-Match``/``If-None-Match`` list, or None when malformed.

    Empty list elements are allowed (RFC 9110 §5.6.1); ``*`` is handled by the callers.
    """
    tags, position, text = [], 0, header.strip()
    while position < len(text):
        separator = _LIST_SEPARATOR.match(text, position)
        if separator and separator.end() > position:
            position = separator.end()
            continue
        tag = _ENTITY_TAG.match(text, position)
        if not tag or tag.end() == position:
            return None
        tags.append((bool(tag.group(1)), tag.group(2)))
        position = tag.end()
        if position < len(text) and not _LIST_SEPARATOR.match(text, position):
            return None
    return tags


def etags_match(a: tuple[bool, str], b: tuple[bool, str], *, weak: bool) -> bool:
    """RFC 9110 §8.8.3.2: strong comparison needs both tags strong and equal; weak ignores ``W/``."""
    if weak:
        return a[1] == b[1]
    return not a[0] and not b[0] and a[1] == b[1]


# An entity tag this module issues: the version, then (for a representation) its digest.
_VERSION_TAG = re.compile(r"([0-9]{1,19})(?:\.[0-9a-f]{1,64})?")


def etag_for(version: int, representation: Any = None) -> str:
    """The ``ETag`` header value of a response carrying one object: a strong validator.

    ``"<version>"`` alone names the object's versioned state. With ``representation`` (the
    response's data, as DRF's JSON renderer encodes it) it is ``"<version>.<digest>"``, the digest 12 hex digits of
    BLAKE2b over the canonical JSON: a strong validator must change whenever the representation
    does (RFC 9110 §8.8.3), and what a GET shows can move without the version — a node's free
    capacity as leases come and go, its liveness, its recent events. ``If-None-Match`` then answers
    304 only for the very representation the client holds, while ``If-Match`` still compares the
    version alone (:func:`version_in_tag`): a heartbeat between an operator's read and action must
    not fail the action.
    """
    if representation is None:
        return f'"{version}"'
    canonical = json.dumps(representation, sort_keys=True, separators=(",", ":"), cls=JSONEncoder)
    return f'"{version}.{hashlib.blake2b(canonical.encode(), digest_size=6).hexdigest()}"'


def version_in_tag(opaque: str) -> int | None:
    """The version an entity tag's opaque part names (``7`` or ``7.<digest>``, as :func:`etag_for`
    issues them), or None for any other tag (which then never matches: 412)."""
    match = _VERSION_TAG.fullmatch(opaque)
    if match is None or int(match.group(1)) >= 2**63:
        return None
    return int(match.group(1))


def expected_version(request) -> ExpectedVersion:
    """The version(s) the client expects, from ``If-Match`` or the body's ``expected_version``.

    ``If-Match`` (RFC 9110 §13.1.1) is a list of entity tags compared strongly: any strong
    ``"<version>"`` or ``"<version>.<digest>"`` in it may match, on its version alone; weak tags
    and other opaque tags never do (412 later).

    Raises:
        PreconditionRequired: neither was sent, or ``If-Match: *`` (428, ``version_required``): an
            operator action must name the version it read.
        Problem: an ``If-Match`` that is not a list of quoted entity tags, e.g. unquoted ``7``
            (400, ``invalid_if_match``); a malformed ``expected_version`` (400, ``invalid_version``);
            a body the parser refuses (400).
    """
    # Parse the body first even when If-Match answers: an action whose view never reads the body
    # must still refuse one the parser refuses (NaN, NUL, not JSON) instead of acting on it.
    data = getattr(request, "data", None)
    header = request.headers.get("If-Match")
    if header is not None:
        if header.strip() == "*":
            raise PreconditionRequired(
                "If-Match: * is not enough for an operator action; send the ETag you read.", VERSION_REQUIRED
            )
        tags = parse_entity_tags(header)
        if not tags:
            raise Problem(
                f"If-Match must be a list of quoted entity tags such as '\"3\"', not {header[:100]!r}.",
                INVALID_IF_MATCH,
            )
        versions = [version_in_tag(opaque) for weak, opaque in tags if not weak]
        return ExpectedVersion([v for v in versions if v is not None])
    value = data.get("expected_version") if isinstance(data, dict) else None
    if value is None:
        raise PreconditionRequired()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Problem("expected_version must be a non-negative integer.", INVALID_VERSION)
    return ExpectedVersion([value])


def check_version(current: int, expected: int) -> None:
    """Raise 412 ``version_mismatch`` unless ``current`` is the expected version (or one of them)."""
    versions = getattr(expected, "versions", None)
    if versions is None:
        versions = {int(expected)}
    if current not in versions:
        shown = f"version {int(expected)}" if len(versions) <= 1 and int(expected) >= 0 else "another version"
        if len(versions) > 1:
            shown = "versions " + ", ".join(str(v) for v in sorted(versions))
        raise PreconditionFailed(
            f"You acted on {shown} but the resource is at version {current}; read it again.",
            current_version=current,
        )


class ETagMixin:
    """DRF view mixin: ``ETag`` on responses carrying one object with a ``version``, and
    ``If-None-Match`` on ``GET``/``HEAD`` answered 304 when it matches (weak comparison, ``*``
    matches any current representation; RFC 9110 §13.1.2).

    ``etag_ignores``: top-level members left out of the ETag's digest because they are computed
    from the clock at each read (a pending request's ``pending_seconds``): with them in, the
    ETag would change every second and a poller would never get a 304.
    """

    etag_ignores: tuple[str, ...] = ()

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        data = getattr(response, "data", None)
        if 200 <= response.status_code < 300 and isinstance(data, dict) and isinstance(data.get("version"), int):
            digested = {k: v for k, v in data.items() if k not in self.etag_ignores} if self.etag_ignores else data
            etag = etag_for(data["version"], digested)
            response["ETag"] = etag
            if request.method in ("GET", "HEAD") and response.status_code == 200 and _none_match(request, etag):
                not_modified = Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
                return super().finalize_response(request, not_modified, *args, **kwargs)
        return response


def _none_match(request, etag: str) -> bool:
    header = request.headers.get("If-None-Match")
    if header is None:
        return False
    if header.strip() == "*":
        return True
    current = (False, etag.strip('"'))
    return any(etags_match(tag, current, weak=True) for tag in parse_entity_tags(header) or [])


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
    obj = queryset.select_for_update(no_key=True).filter(**lookup).first()
    if obj is None:
        raise NotFound(f"No {queryset.model._meta.verbose_name} matches the given query.")
    check_version(obj.version, expected)
    return obj
