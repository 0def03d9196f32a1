"""The project's filter backend: django-filter's, with one rule of the API contract added.

django-filter reads a parameter sent empty (``?node=``, ``?state=``) as "no filter" and answers
every row. nodepool refuses it instead (docs/api-contract.md, "Filters"): a client that meant to
filter and sent nothing must not be handed the whole collection.
"""

from __future__ import annotations

from django_filters.rest_framework import DjangoFilterBackend

from .problems import Problem


class StrictFilterBackend(DjangoFilterBackend):
    """``DjangoFilterBackend`` that refuses a declared filter sent with only empty values.

    Raises:
        Problem: 400 ``invalid_filter`` naming the parameter; nothing is filtered then.
    """

    def get_filterset(self, request, queryset, view):
        filterset = super().get_filterset(request, queryset, view)
        if filterset is not None:
            params = request.query_params
            for name in filterset.filters:
                if name in params and not "".join(params.getlist(name)).strip():
                    raise Problem(f"{name}: give a value, or leave the parameter out", "invalid_filter", field=name)
        return filterset
