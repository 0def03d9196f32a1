"""Kubernetes label selectors over a node's JSON label columns.

The grammar is Kubernetes' (k8s.io/apimachinery/pkg/labels, ``Parse``): comma-separated
requirements, all of which must hold::

    zone=a            equality (also ``zone==a``)
    zone!=a           inequality: the label is absent or has another value
    zone in (a,b)     set membership
    zone notin (a)    absent, or not one of the values
    gpu               the label exists
    !gpu              the label does not exist

Keys are Kubernetes label keys (``topology.kubernetes.io/zone``); values are label values
(at most 63 characters of ``[A-Za-z0-9._-]``, alphanumeric at both ends, or empty).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.db.models import Q
from django.db.models.fields.json import KeyTransform

from .capability import label_key_ok

_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SET = re.compile(r"^(!?)\s*([^\s=!(),]+)\s+(in|notin)\s*\((.*)\)$")
_EQUALITY = re.compile(r"^([^\s=!(),]+)\s*(==|=|!=)\s*([^\s=!(),]*)$")
_EXISTS = re.compile(r"^(!?)\s*([^\s=!(),]+)$")
MAX_SELECTOR = 1000


class SelectorError(ValueError):
    """A selector that is not valid Kubernetes label-selector syntax; the message says where."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()


def _split(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, current = [], 0, []
    for char in selector:
        if char == "(":
            depth += 1
            if depth > 1:
                raise SelectorError("nested parentheses")
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError("unbalanced ')'")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise SelectorError("unbalanced '('")
    parts.append("".join(current))
    return [part.strip() for part in parts]


def _key(key: str) -> str:
    if not label_key_ok(key):
        raise SelectorError(f"{key!r} is not a label key")
    return key


def _value(value: str) -> str:
    if not _VALUE.match(value):
        raise SelectorError(f"{value!r} is not a label value")
    return value


def parse_selector(selector: str) -> list[Requirement]:
    """Parse ``selector`` into requirements (all must hold); ``""`` selects everything.

    Raises:
        SelectorError: the selector is malformed (empty requirement, bad key or value, unbalanced
            parentheses, an empty set, longer than 1000 characters).
    """
    if len(selector) > MAX_SELECTOR:
        raise SelectorError(f"longer than {MAX_SELECTOR} characters")
    if not selector.strip():
        return []
    requirements = []
    for part in _split(selector):
        if not part:
            raise SelectorError("an empty requirement (two commas, or a trailing comma)")
        if match := _SET.match(part):
            negated, key, operator, inner = match.groups()
            if negated:
                raise SelectorError(f"{part!r}: '!' goes only before a bare key")
            values = tuple(_value(v.strip()) for v in inner.split(","))
            if not inner.strip():
                raise SelectorError(f"{part!r}: an empty set of values")
            requirements.append(Requirement(_key(key), operator, values))
        elif match := _EQUALITY.match(part):
            key, operator, value = match.groups()
            requirements.append(Requirement(_key(key), "!=" if operator == "!=" else "=", (_value(value),)))
        elif match := _EXISTS.match(part):
            negated, key = match.groups()
            requirements.append(Requirement(_key(key), "!exists" if negated else "exists"))
        else:
            raise SelectorError(f"{part!r} is not a requirement (k=v, k!=v, k in (a,b), k notin (a), k, !k)")
    return requirements


def filter_by_selector(queryset, column: str, selector: str, *, alias_prefix: str = ""):
    """``queryset`` narrowed to rows whose JSON object ``column`` matches ``selector``.

    Raises:
        SelectorError: see :func:`parse_selector`.
    """
    for index, req in enumerate(parse_selector(selector)):
        has = Q(**{f"{column}__has_key": req.key})
        if req.operator == "exists":
            queryset = queryset.filter(has)
            continue
        if req.operator == "!exists":
            queryset = queryset.exclude(has)
            continue
        # KeyTransform compares JSON values on SQLite and PostgreSQL alike, and takes the key
        # whole, so keys with dots, slashes or '__' (topology.kubernetes.io/zone) stay one key.
        alias = f"_sel{alias_prefix}_{column}_{index}"
        queryset = queryset.alias(**{alias: KeyTransform(req.key, column)})
        matches = Q(**{alias: req.values[0]}) if req.operator in ("=", "!=") else Q(**{f"{alias}__in": req.values})
        if req.operator in ("=", "in"):
            queryset = queryset.filter(has & matches)
        else:  # "!=", "notin": absent, or present with another value (Kubernetes' semantics)
            queryset = queryset.filter(~has | (has & ~matches))
    return queryset
