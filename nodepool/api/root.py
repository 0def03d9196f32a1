from django.urls import NoReverseMatch, reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.response import Response

# URL names listed at the API root when they exist (apps register them in their api/urls.py).
ROOT_LINKS = [
    "node-list",
    "pool-list",
    "node-enrollment",
    "bootstraptoken-list",
    "lease-list",
    "leaserequest-list",
    "shape-list",
    "fencing-validate",
    "drain-list",
    "disruptionbudget-list",
]


@extend_schema(responses=OpenApiTypes.OBJECT)
@api_view(["GET"])
@permission_classes([AllowAny])
def api_root(request):
    """Index of the v1 API, with links to the schema and docs."""
    links = {}
    for name in ROOT_LINKS:
        try:
            links[name] = request.build_absolute_uri(reverse(name))
        except NoReverseMatch:
            continue
    links["schema"] = request.build_absolute_uri(reverse("schema"))
    links["docs"] = request.build_absolute_uri(reverse("api-docs"))
    return Response({"name": "nodepool", "version": "v1", "links": links})
