from django.urls import path

from .heartbeat_views import HeartbeatView, NodeMetricsView

urlpatterns: list = [
    path("nodes/<uuid:pk>/heartbeats", HeartbeatView.as_view(), name="node-heartbeats"),
    path("nodes/<uuid:pk>/metrics", NodeMetricsView.as_view(), name="node-metrics"),
]
