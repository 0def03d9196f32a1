"""A JSON parser that bounds body size and nesting depth before the view sees anything."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework import exceptions
from rest_framework.parsers import JSONParser

from .problems import PayloadTooLarge, Unprocessable


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
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"The request body is {declared} bytes; the limit here is {limit} bytes.")
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
        try:
            data = json.loads(raw.decode("utf-8"))
        except RecursionError as exc:
            raise Unprocessable("The JSON document is nested too deeply.", "json_too_deep") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"Malformed JSON: {exc}") from exc
        if json_depth(data, max_depth) > max_depth:
            raise Unprocessable(f"The JSON document is nested deeper than {max_depth} levels.", "json_too_deep")
        return data
