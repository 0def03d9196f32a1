"""The project's filter backend and filter-set base: django-filter's, with the API contract's rules.

django-filter reads a parameter sent empty (``?node=``, ``?state=``) as "no filter", ignores one it
does not declare, and answers a bad value with a generic error. nodepool refuses all three with
400 ``invalid_filter`` instead (docs/api-contract.md, "Filters"): a client that meant to filter
must not be handed the whole collection, nor an empty one it reads as "none".
"""

from __future__ import annotations

import django_filters
from django_filters.rest_framework import DjangoFilterBackend

from nodepool.api.errors import INVALID_FILTER

from .problems import Problem

# Query parameters every list takes besides its filters, whatever its paginator (DRF's format override too).
NON_FILTER_PARAMETERS = frozenset({"page", "page_size", "cursor", "format"})


def refuse_unknown_parameters(params, known, filters=()) -> None:
    """Refuse a query parameter that is not in ``known`` (``format`` is always known).

    Args:
        params: the query parameters (a QueryDict or a dict).
        known: the names the endpoint reads.
        filters: the names to list in the answer (default: ``known``).

    Raises:
        Problem: 400 ``invalid_filter`` naming the first unknown parameter, with ``errors``.
    """
    known = set(known) | {"format"}
    unknown = sorted(name for name in params if name not in known)
    if not unknown:
        return
    listed = ", ".join(sorted(filters or set(known) - {"format"})) or "none"
    errors = [
        {"field": name, "code": "unknown_filter", "message": f"not a parameter of this endpoint (it takes: {listed})"}
        for name in unknown
    ]
    raise Problem(
        f"Unknown parameter {', '.join(unknown)}; this endpoint takes {listed}.",
        INVALID_FILTER,
        field=unknown[0],
        errors=errors,
    )


class StrictFilterSet(django_filters.FilterSet):
    """A FilterSet that answers ``400 invalid_filter`` instead of narrowing nothing.

    django-filter ignores a parameter it does not declare (``?pool=`` on a list filtered by
    ``pool__name``, ``?foo=bar``) and the backend turns a bad value into a generic
    ``validation_error``; either way a client that meant to narrow the list may be handed the whole
    collection, or an empty one it reads as "none". This base refuses both, naming the parameter,
    with the per-parameter messages in ``errors`` (``{"field", "code", "message"}``) like a
    validation error. Empty values are refused before this by :class:`StrictFilterBackend`.

    Raises (from :meth:`is_valid`, which the filter backend calls before filtering):
        Problem: 400 ``invalid_filter``.
    """

    def known_parameters(self) -> set[str]:
        """The filters, and the paginator's parameters of the view (if any)."""
        known = set(self.filters) | NON_FILTER_PARAMETERS
        view = (getattr(self.request, "parser_context", None) or {}).get("view")
        paginator = getattr(view, "paginator", None) if view is not None else None
        for attribute in ("page_query_param", "page_size_query_param", "cursor_query_param"):
            if isinstance(getattr(paginator, attribute, None), str):
                known.add(getattr(paginator, attribute))
        return known

    def is_valid(self) -> bool:
        refuse_unknown_parameters(self.data, self.known_parameters(), self.filters)
        if not super().is_valid():
            errors = [
                {"field": name, "code": error.code or "invalid", "message": self._message(name, error)}
                for name, field_errors in self.form.errors.as_data().items()
                for error in field_errors
            ]
            detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
            raise Problem(f"Invalid filter: {detail}", INVALID_FILTER, field=errors[0]["field"], errors=errors)
        return True

    def _message(self, name: str, error) -> str:
        message = " ".join(error.messages)
        choices = getattr(self.filters.get(name), "extra", {}).get("choices")
        choices = choices() if callable(choices) else choices  # a registry's (fleet.event_types)
        if error.code == "invalid_choice" and choices:
            message += f" Choose from {', '.join(str(value) for value, _ in choices)}."
        return message


class StrictFilterBackend(DjangoFilterBackend):
    """``DjangoFilterBackend`` that refuses a declared filter sent with only empty values. A view's
    ``filterset_fields`` (no ``filterset_class``) get an automatic StrictFilterSet too.

    Raises:
        Problem: 400 ``invalid_filter`` naming the parameter; nothing is filtered then.
    """

    filterset_base = StrictFilterSet

    def get_filterset(self, request, queryset, view):
        filterset = super().get_filterset(request, queryset, view)
        if filterset is not None:
            params = request.query_params
            for name in filterset.filters:
                if name in params and not "".join(params.getlist(name)).strip():
                    raise Problem(f"{name}: give a value, or leave the parameter out", INVALID_FILTER, field=name)
        return filterset
