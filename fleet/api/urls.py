"""Fleet URLs under /api/v1/. Heartbeats and maintenance register their own node paths elsewhere."""

from django.urls import path

from . import device_views, events, views
from .heartbeat_views import HeartbeatView, NodeMetricsView

pool_list = views.PoolViewSet.as_view({"get": "list", "post": "create"})
pool_detail = views.PoolViewSet.as_view(
    {"get": "retrieve", "put": "update", "patch": "partial_update", "delete": "destroy"}
)
token_list = views.BootstrapTokenViewSet.as_view({"get": "list", "post": "create"})
token_detail = views.BootstrapTokenViewSet.as_view({"get": "retrieve"})
token_revoke = views.BootstrapTokenViewSet.as_view({"post": "revoke"})
node_list = views.NodeViewSet.as_view({"get": "list"})
node_detail = views.NodeViewSet.as_view({"get": "retrieve"})

urlpatterns = [
    # Pools and bootstrap tokens (operators).
    path("pools", pool_list, name="pool-list"),
    path("pools/<slug:name>", pool_detail, name="pool-detail"),
    path("bootstrap-tokens", token_list, name="bootstraptoken-list"),
    path("bootstrap-tokens/<int:pk>", token_detail, name="bootstraptoken-detail"),
    path("bootstrap-tokens/<int:pk>/revoke", token_revoke, name="bootstraptoken-revoke"),
    # Enrollment (bootstrap token in the body).
    path("node-enrollments", views.NodeEnrollmentView.as_view(), name="node-enrollment"),
    # Nodes: reading (operators, clients, owners for their own).
    path("nodes", node_list, name="node-list"),
    path("nodes/<uuid:pk>", node_detail, name="node-detail"),
    # Admission (operator) and benchmark results (the node itself).
    path("nodes/<uuid:pk>/admit", views.NodeAdmitView.as_view(), name="node-admit"),
    path("nodes/<uuid:pk>/benchmarks/<str:nonce>", views.BenchmarkResultView.as_view(), name="node-benchmark-result"),
    # Node credentials: operator issue and revoke, node rotation.
    path("nodes/<uuid:pk>/credentials", views.NodeCredentialIssueView.as_view(), name="node-credential-issue"),
    path("nodes/<uuid:pk>/credentials/revoke", views.NodeCredentialRevokeView.as_view(), name="node-credential-revoke"),
    path("nodes/<uuid:pk>/credentials/rotate", views.NodeCredentialRotateView.as_view(), name="node-credential-rotate"),
    # Devices (fleet.devices): reading, and the operator's device actions.
    path("nodes/<uuid:pk>/devices", device_views.NodeDeviceList.as_view(), name="node-devices"),
    path(
        "nodes/<uuid:pk>/devices/<path:device_id>/verify", device_views.DeviceVerifyView.as_view(), name="device-verify"
    ),
    path("nodes/<uuid:pk>/devices/<path:device_id>/taint", device_views.DeviceTaintView.as_view(), name="device-taint"),
    path(
        "nodes/<uuid:pk>/devices/<path:device_id>/untaint",
        device_views.DeviceUntaintView.as_view(),
        name="device-untaint",
    ),
    path(
        "nodes/<uuid:pk>/devices/<path:device_id>/release",
        device_views.DeviceReleaseView.as_view(),
        name="device-release",
    ),
    # Re-verification (fleet.reverification): the node's verification state and history.
    path("nodes/<uuid:pk>/verification", device_views.NodeVerificationView.as_view(), name="node-verification"),
    # Events: the fleet's stream and one node's timeline.
    path("events", events.EventList.as_view(), name="event-list"),
    path("nodes/<uuid:pk>/events", events.NodeEventTimeline.as_view(), name="node-events"),
    # Heartbeats and detailed metrics (the node itself).
    path("nodes/<uuid:pk>/heartbeats", HeartbeatView.as_view(), name="node-heartbeats"),
    # Liveness renewals (POST nodes/<id>/renewals) are routed first of all, in nodepool/urls.py.
    path("nodes/<uuid:pk>/metrics", NodeMetricsView.as_view(), name="node-metrics"),
]
