"""Schema truth: every operation declares the problem+json statuses it can answer.

``NodepoolAutoSchema`` (drf-spectacular's ``DEFAULT_SCHEMA_CLASS``) adds to each operation:

* every method: 400, 401, 403, 404, 406, 429, 431 and 503 (the plumbing can answer these anywhere:
  bad query parameters, authentication, roles, unknown ids, ``Accept``, throttles, oversized
  headers, a database outage);
* writes (POST, PUT, PATCH, DELETE): also 409, 410, 412, 413, 415, 422 and 428 (conflicts, retired
  nodes, ``If-Match``/``expected_version``, body limits, media type, JSON depth);
* ``GET`` on a view with :class:`~nodepool.api.versioning.ETagMixin`: 304 (``If-None-Match``);

each with the ``Problem`` schema under ``application/problem+json``. A view that answers another
status declares it with :func:`problem_responses`, on the class or on one handler method::

    from nodepool.api.openapi import problem_responses

    @problem_responses(402)            # every operation of the view
    class RenewalView(APIView): ...

    class HoldViewSet(viewsets.ViewSet):
        @problem_responses(423)        # this operation only
        def create(self, request): ...

Statuses an operation declares itself (``@extend_schema(responses={409: ...})``) are kept as they are.
"""

from __future__ import annotations

from django.core.exceptions import FieldDoesNotExist
from rest_framework import serializers

from .problems import _TITLES, PROBLEM_CONTENT_TYPE
from .schema import AreaAutoSchema
from .versioning import ETagMixin

READ_PROBLEMS = (400, 401, 403, 404, 406, 429, 431, 503)
WRITE_PROBLEMS = (409, 410, 412, 413, 415, 422, 428)
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def problem_responses(*statuses: int):
    """Declare extra problem statuses for a view class or one handler method (see the module doc)."""

    def decorate(target):
        target.problem_statuses = tuple(sorted({*getattr(target, "problem_statuses", ()), *statuses}))
        return target

    return decorate


class FieldErrorSerializer(serializers.Serializer):
    field = serializers.CharField(help_text='the member, "a.b" or "items[2]"; "" for the whole body')
    code = serializers.CharField()
    message = serializers.CharField()


class ProblemSerializer(serializers.Serializer):
    """RFC 9457 problem details; members beyond these carry the specifics (``current_version``...)."""

    type = serializers.URLField()
    title = serializers.CharField()
    status = serializers.IntegerField()
    detail = serializers.CharField()
    code = serializers.CharField(help_text="stable, machine-readable (snake_case)")
    deprecated_code = serializers.CharField(
        required=False, help_text="the older name of a renamed code, for one release (docs/api-contract.md)"
    )
    request_id = serializers.CharField(required=False)
    errors = FieldErrorSerializer(many=True, required=False)


class NodepoolAutoSchema(AreaAutoSchema):
    """The area-tagging AutoSchema (nodepool.api.schema) plus the problem statuses of every operation."""

    def problem_statuses(self) -> set[int]:
        statuses = set(READ_PROBLEMS)
        if self.method in WRITE_METHODS:
            statuses |= set(WRITE_PROBLEMS)
        statuses |= set(getattr(self.view, "problem_statuses", ()))
        handler = getattr(self.view, getattr(self.view, "action", None) or self.method.lower(), None)
        statuses |= set(getattr(handler, "problem_statuses", ()))
        return statuses

    def _map_serializer_field(self, field, direction, bypass_extensions=False):
        """A read-only related field over a nullable foreign key is nullable (``owner``, ``created_by``):
        drf-spectacular only looks at ``allow_null``, which read-only fields leave unset."""
        schema = super()._map_serializer_field(field, direction, bypass_extensions)
        if isinstance(field, serializers.RelatedField) and not schema.get("nullable"):
            model = getattr(getattr(field.parent, "Meta", None), "model", None)
            if model is not None and field.source and "." not in field.source:
                try:
                    nullable = model._meta.get_field(field.source).null
                except FieldDoesNotExist:
                    nullable = False
                if nullable:
                    schema["nullable"] = True
        return schema

    def _get_filter_parameters(self):
        """Filter parameters as declared, a string one with ``minLength: 1``: the filter backend
        refuses a filter sent empty (nodepool.api.filters.StrictFilterBackend)."""
        parameters = super()._get_filter_parameters()
        for parameter in parameters:
            if parameter.get("schema", {}).get("type") == "string":
                parameter["schema"].setdefault("minLength", 1)
        return parameters

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        if direction != "response":
            return responses
        problem = self.resolve_serializer(ProblemSerializer, "response")
        for status in sorted(self.problem_statuses()):
            responses.setdefault(
                str(status),
                {
                    "description": _TITLES.get(status, "Error"),
                    "content": {PROBLEM_CONTENT_TYPE: {"schema": problem.ref}},
                },
            )
        if self.method == "GET" and isinstance(self.view, ETagMixin):
            responses.setdefault("304", {"description": "Not Modified: If-None-Match matched the current ETag"})
        return responses
