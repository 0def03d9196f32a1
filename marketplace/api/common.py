"""What the marketplace API's views share: who may call them, and how a request body is read
(an object of known members; required text; decimal strings; aware times), each bad field a 400
problem with a stable code."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from rest_framework.permissions import BasePermission

from nodepool.api.errors import INVALID_BODY
from nodepool.api.fields import parse_aware_datetime
from nodepool.api.permissions import is_client, is_operator, is_owner
from nodepool.api.problems import Problem
from nodepool.api.strict import refuse_unknown_members

from ..errors import INVALID_DECIMAL, INVALID_FIELD

MAX_TEXT = 4000


class IsOperatorOrOwner(BasePermission):
    message = "Only operators and marketplace owners may read this."

    def has_permission(self, request, view):
        return is_operator(request.user) or is_owner(request.user)


class IsOperator(BasePermission):
    message = "Only operators may do this."

    def has_permission(self, request, view):
        return is_operator(request.user)


class ReadForAllWriteForOperators(BasePermission):
    message = "Only operators may change prices."

    def has_permission(self, request, view):
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return is_operator(request.user) or is_owner(request.user) or is_client(request.user)
        return is_operator(request.user)


def read_body(request, members) -> dict:
    """The request body, an object holding only ``members`` (400 ``invalid_body`` when it is not
    an object, 400 ``unknown_field`` for any other member: nodepool.api.strict)."""
    data = request.data
    if not isinstance(data, dict):
        raise Problem("The body must be a JSON object.", INVALID_BODY)
    return refuse_unknown_members(data, members)


def read_text(data: dict, name: str, *, required: bool = True, limit: int = MAX_TEXT) -> str:
    value = data.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()) or len(value) > limit:
        raise Problem(f"{name}: required, a non-empty string of at most {limit} characters.", INVALID_FIELD, field=name)
    return value.strip()


def read_decimal(data: dict, name: str, *, required: bool = True) -> Decimal | None:
    value = data.get(name)
    if value is None and not required:
        return None
    # Money and quantities travel as decimal strings: a JSON number is a float in most clients.
    if not isinstance(value, str) or len(value) > 40:
        raise Problem(f'{name}: a decimal string such as "0.60" (not a JSON number).', INVALID_DECIMAL, field=name)
    try:
        number = Decimal(value)
    except InvalidOperation as exc:
        raise Problem(f"{name}: {value[:40]!r} is not a decimal number.", INVALID_DECIMAL, field=name) from exc
    if not number.is_finite() or number < 0:
        raise Problem(f"{name}: must be a finite, non-negative decimal.", INVALID_DECIMAL, field=name)
    return number


def read_datetime(data: dict, name: str):
    return parse_aware_datetime(data.get(name), name)
