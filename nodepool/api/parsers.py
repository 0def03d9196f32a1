"""A JSON parser that bounds body size and nesting depth before the view sees anything.

It also refuses JSON that no column can store faithfully, so that every endpoint answers 400
instead of a 409/500 from the database: ``NaN``/``Infinity`` (and floats that overflow to
infinity), integers outside the signed 64-bit range, ``\\u0000`` (PostgreSQL refuses NUL in text
and jsonb), lone surrogates (not encodable as UTF-8) and duplicate object keys (ambiguous: which
one wins depends on the reader).
"""

from __future__ import annotations

import json
import math
from typing import Any

from django.conf import settings
from rest_framework import exceptions
from rest_framework.parsers import JSONParser

from nodepool.api.errors import (
    DUPLICATE_KEY,
    INVALID_UNICODE,
    JSON_TOO_DEEP,
    NON_FINITE_NUMBER,
    NUL_CHARACTER,
    NUMBER_OUT_OF_RANGE,
)

from .problems import PayloadTooLarge, Problem, Unprocessable

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _refuse_constant(name: str) -> Any:
    raise Problem(f"{name} is not a JSON number; send a finite number.", NON_FINITE_NUMBER)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Problem(f"The number {text[:40]} is too large to be stored.", NON_FINITE_NUMBER)
    return value


def _int64(text: str) -> int:
    # Python refuses integers of more than 4300 digits itself (ValueError: malformed_body).
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise Problem(
            f"The integer {text[:40]}{'…' if len(text) > 40 else ''} is outside the signed 64-bit range.",
            NUMBER_OUT_OF_RANGE,
        )
    return value


def _check_string(value: str) -> str:
    if "\x00" in value:
        raise Problem("Strings may not contain the NUL character (\\u0000).", NUL_CHARACTER)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Problem("A string contains a lone UTF-16 surrogate (e.g. \\ud800).", INVALID_UNICODE) from exc
    return value


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise Problem(f"The key {key[:40]!r} appears twice in one JSON object.", DUPLICATE_KEY)
        obj[_check_string(key)] = value
    return obj


def _check_strings(value: Any) -> None:
    """Check every string value (keys are checked while parsing) without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def loads_strict(text: str) -> Any:
    """``json.loads`` that refuses what nodepool cannot store (see the module docstring).

    Raises:
        Problem: 400 with code ``non_finite_number``, ``number_out_of_range``, ``nul_character``,
            ``invalid_unicode`` or ``duplicate_key``.
        ValueError: not JSON at all.
    """
    data = json.loads(
        text,
        parse_constant=_refuse_constant,
        parse_float=_finite_float,
        parse_int=_int64,
        object_pairs_hook=_unique_object,
    )
    _check_strings(data)
    return data


def json_depth(value: Any, limit: int) -> int:
    """Depth of nested lists/dicts in ``value`` (a scalar is 0); stops counting past ``limit``."""
    depth = 0
    frontier = [value]
    while frontier and depth <= limit:
        nested = []
        for item in frontier:
            if isinstance(item, dict):
                nested.extend(item.values())
            elif isinstance(item, list):
                nested.extend(item)
        if not nested and not any(isinstance(i, dict | list) for i in frontier):
            break
        depth += 1
        frontier = nested
    return depth


class BoundedJSONParser(JSONParser):
    """JSON parser with limits.

    Views may set ``max_body_bytes`` (bytes) and ``max_json_depth`` to tighten the project-wide
    ``NODEPOOL_MAX_BODY_BYTES`` / ``NODEPOOL_MAX_JSON_DEPTH``.

    Raises:
        Problem: JSON nodepool cannot store (400; see :func:`loads_strict` for the codes).
        PayloadTooLarge: body longer than the limit (413, code ``payload_too_large``).
        ParseError: not JSON (400, code ``malformed_body``).
        Unprocessable: nested deeper than the limit (422, code ``json_too_deep``).
    """

    def parse(self, stream, media_type=None, parser_context=None):
        view = (parser_context or {}).get("view")
        limit = getattr(view, "max_body_bytes", None) or settings.NODEPOOL_MAX_BODY_BYTES
        max_depth = getattr(view, "max_json_depth", None) or settings.NODEPOOL_MAX_JSON_DEPTH
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"The request body is {declared} bytes; the limit here is {limit} bytes.")
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
        try:
            data = loads_strict(raw.decode("utf-8"))
        except RecursionError as exc:
            raise Unprocessable("The JSON document is nested too deeply.", JSON_TOO_DEEP) from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"Malformed JSON: {exc}") from exc
        if json_depth(data, max_depth) > max_depth:
            raise Unprocessable(f"The JSON document is nested deeper than {max_depth} levels.", JSON_TOO_DEEP)
        return data
