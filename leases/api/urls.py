from django.urls import path

from . import capacity_views, views

urlpatterns = [
    path("node-leases", views.LeaseListCreate.as_view(), name="lease-list"),
    path("node-leases/<uuid:pk>", views.LeaseDetail.as_view(), name="lease-detail"),
    path("node-leases/<uuid:pk>/renew", views.LeaseRenew.as_view(), name="lease-renew"),
    path("node-leases/<uuid:pk>/release", views.LeaseRelease.as_view(), name="lease-release"),
    path("node-leases/<uuid:pk>/checkpoint", views.LeaseCheckpoint.as_view(), name="lease-checkpoint"),
    path("node-leases/<uuid:lease_id>/events", views.LeaseEvents.as_view(), name="lease-events"),
    path("lease-requests", views.LeaseRequestList.as_view(), name="leaserequest-list"),
    path("lease-requests/<uuid:pk>", views.LeaseRequestDetail.as_view(), name="leaserequest-detail"),
    path("shapes", views.ShapeListCreate.as_view(), name="shape-list"),
    path("shapes/<int:pk>", views.ShapeDetail.as_view(), name="shape-detail"),
    path("fencing/validate", views.FencingValidate.as_view(), name="fencing-validate"),
    path("pools/<slug:name>/capacity", capacity_views.PoolCapacity.as_view(), name="pool-capacity"),
    path("placement-previews", capacity_views.PlacementPreviews.as_view(), name="placement-preview"),
    path("lease-consistency-reports", views.ConsistencyReportList.as_view(), name="leaseconsistency-list"),
]
