from django.conf import settings
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from . import health
from .api.root import api_root

handler400 = "nodepool.api.problems.handler400"
handler403 = "nodepool.api.problems.handler403"
handler404 = "nodepool.api.problems.handler404"
handler500 = "nodepool.api.problems.handler500"

api_v1 = [
    path("", api_root, name="api-root"),
    path("", include("fleet.api.urls")),
    path("", include("leases.api.urls")),
    path("", include("maintenance.api.urls")),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api-auth/", include("rest_framework.urls")),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
]

if settings.NODEPOOL_BENCH:  # benchmarks only: the baseline view bench/heartbeats.py compares with
    from .bench_views import one_update

    urlpatterns.append(path("bench/one-update/<uuid:pk>", one_update, name="bench-one-update"))
