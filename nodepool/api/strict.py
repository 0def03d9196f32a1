"""Strict request bodies, shared by every app's API.

A member the endpoint does not know is a 400 (``unknown_field``), never ignored: a mistyped or
misplaced option (``"dry_run": true`` in a drain's body instead of ``?dry_run=true``,
``"expires_in"`` for ``expires_at``) would otherwise do the real, unqualified thing. A boolean is a
JSON ``true`` or ``false``: DRF's BooleanField also takes ``"yes"``, ``"on"`` or ``1``, and an
option such as ``issue_credential`` or ``force`` must not be switched on by a string. A string
member is a JSON string: DRF's CharField would store the number ``5`` as ``"5"``.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from rest_framework import serializers
from rest_framework.settings import api_settings

from nodepool.api.errors import MALFORMED_BODY, PROTECTED_FIELD, UNKNOWN_FIELD

from .problems import Problem

# Accepted by every strict body: the version an operator action acts on (nodepool.api.versioning).
PASSTHROUGH = frozenset({"expected_version"})


def refuse_unknown_members(data: Any, allowed, *, what: str = "members") -> dict:
    """Check a request body read without a serializer; returns it.

    Args:
        data: the parsed body.
        allowed: the member names the endpoint reads (``expected_version`` is always allowed).

    Raises:
        Problem: 400 ``malformed_body`` (not a JSON object), 400 ``unknown_field`` (with ``fields``).
    """
    if not isinstance(data, dict):
        raise Problem("The request body must be a JSON object.", MALFORMED_BODY)
    unknown = sorted(map(str, set(data) - set(allowed) - PASSTHROUGH))
    if unknown:
        raise Problem(f"Unknown {what}: {', '.join(unknown)}.", UNKNOWN_FIELD, fields=unknown)
    return data


class StrictInput:
    """Mixin for input serializers (plain or model): refuses members it does not declare as
    writable (``unknown_field``; ``protected_field`` for the names in ``protected_fields``,
    attributes only the control plane sets), and a non-string for a string field."""

    protected_fields: frozenset[str] = frozenset()

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            if self.parent is not None:  # a nested member, e.g. enrollment's ``attestation``
                raise serializers.ValidationError({api_settings.NON_FIELD_ERRORS_KEY: ["Must be a JSON object."]})
            raise Problem("The request body must be a JSON object.", MALFORMED_BODY)
        writable = {name for name, field in self.fields.items() if not field.read_only}
        unknown = set(data) - writable - PASSTHROUGH
        protected = sorted(unknown & self.protected_fields)
        if protected:
            raise Problem(
                f"These attributes are set by the control plane, not by the client: {', '.join(protected)}.",
                PROTECTED_FIELD,
                fields=protected,
            )
        refuse_unknown_members(data, writable)
        not_strings = {
            name: ["Must be a string."]
            for name, field in self.fields.items()
            if isinstance(field, serializers.CharField) and not field.read_only and data.get(name) is not None
            and not isinstance(data[name], str)
        }  # fmt: skip
        if not_strings:
            raise serializers.ValidationError(not_strings)
        return super().to_internal_value(data)


class StrictSerializer(StrictInput, serializers.Serializer):
    """A plain input serializer with :class:`StrictInput`'s rules."""


class StrictBooleanField(serializers.BooleanField):
    """A JSON ``true`` or ``false``, nothing else (400 ``invalid``)."""

    default_error_messages = {"invalid": "Must be true or false (a JSON boolean)."}

    def to_internal_value(self, data):
        if isinstance(data, bool):
            return data
        self.fail("invalid")


# Strict JSON types for the serializers that describe a body a hand validator checks (the heartbeat's,
# the lease request's): a JSON integer, string or choice, never one converted from another type.


class WholeMatch(RegexValidator):
    """A RegexValidator whose pattern must match the whole value, as hand validators'
    ``fullmatch``: Django's ``search`` lets ``$`` match before a trailing newline (``"Ready\\n"``).
    Still a RegexValidator, so the schema shows its pattern."""

    def __call__(self, value):
        if not self.regex.fullmatch(str(value)):
            raise ValidationError(self.message, code=self.code, params={"value": value})


class JSONInteger(serializers.IntegerField):
    """A JSON integer: DRF's IntegerField also takes ``"5"``, ``5.0`` and ``true``."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class JSONString(serializers.CharField):
    """A JSON string, untrimmed: DRF's CharField also takes numbers (as their text)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class JSONChoice(serializers.ChoiceField):
    """One of the choices as a JSON string: DRF's ChoiceField compares ``str(value)``, so ``true``
    would pass for ``"True"``."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid_choice", input=data)
        return super().to_internal_value(data)


class JSONUUID(serializers.UUIDField):
    """A UUID as a JSON string: DRF's UUIDField also takes an integer."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid", value=data)
        return super().to_internal_value(data)
