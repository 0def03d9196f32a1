"""Every operation of the live OpenAPI schema, with concrete paths, for tests that must cover every
endpoint — including the ones other issues add later — without listing them by hand."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from drf_spectacular.generators import SchemaGenerator

METHODS = ("get", "post", "put", "patch", "delete")


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    path: str
    operation_id: str
    anonymous: bool  # the schema lets callers without credentials in (enrollment, ...)
    responses: tuple[str, ...]
    query: tuple[str, ...] = ()  # names of its query parameters

    def __str__(self) -> str:
        return f"{self.method.upper()} {self.template}"


def _sample(parameter: dict) -> str:
    schema = parameter.get("schema") or {}
    if schema.get("type") == "integer":
        return "1"
    if schema.get("format") == "uuid":
        return str(uuid.UUID(int=1))
    return "x"


def schema_operations() -> list[Operation]:
    """All operations of ``/api/schema/`` (the same generator), path parameters filled with samples."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    out = []
    for template, item in sorted(schema["paths"].items()):
        for method in METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            path = template
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path":
                    path = path.replace("{" + parameter["name"] + "}", _sample(parameter))
            security = operation.get("security")
            anonymous = security is None or security == [] or {} in security
            out.append(
                Operation(
                    method,
                    template,
                    path,
                    operation["operationId"],
                    anonymous,
                    tuple(operation.get("responses", {})),
                    tuple(p["name"] for p in operation.get("parameters", []) if p.get("in") == "query"),
                )
            )
    return out
