from django.conf import settings
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from fleet.api.renewal_views import renewal_view
from leases.admin_views import fleet_overview_view
from maintenance.admin_views import node_drain_view

from . import health
from .api.auth_views import LogoutEverywhere, UserLogoutEverywhere
from .api.root import api_root
from .metrics import metrics_view

handler400 = "nodepool.api.problems.handler400"
handler403 = "nodepool.api.problems.handler403"
handler404 = "nodepool.api.problems.handler404"
handler500 = "nodepool.api.problems.handler500"

api_v1 = [
    path("", api_root, name="api-root"),
    path("auth/logout-everywhere", LogoutEverywhere.as_view(), name="logout-everywhere"),
    path("users/<str:username>/logout-everywhere", UserLogoutEverywhere.as_view(), name="user-logout-everywhere"),
    path("", include("fleet.api.urls")),
    path("", include("leases.api.urls")),
    path("", include("maintenance.api.urls")),
    path("", include("operations.api.urls")),
    path("", include("marketplace.api.urls")),
]

urlpatterns = [
    # The hottest path first: a renewal is resolved by the first pattern, not after a walk through
    # every API route (that walk cost a tenth of a renewal's CPU time).
    path("api/v1/nodes/<uuid:pk>/renewals", renewal_view, name="node-renewals"),
    path("admin/fleet-overview/", admin.site.admin_view(fleet_overview_view), name="admin-fleet-overview"),
    path("admin/fleet/node/<uuid:pk>/drain/", admin.site.admin_view(node_drain_view), name="admin-node-drain"),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api-auth/", include("rest_framework.urls")),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
]

if settings.NODEPOOL_BENCH:  # benchmarks only: the baseline views bench/heartbeats.py and bench/placement.py use
    from .bench_views import one_grant, one_update

    urlpatterns += [
        path("bench/one-update/<uuid:pk>", one_update, name="bench-one-update"),
        path("bench/one-grant", one_grant, name="bench-one-grant"),
    ]
