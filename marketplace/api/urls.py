"""Marketplace URLs under /api/v1/ (docs/api-contract.md, "Marketplace")."""

from django.urls import path

from . import views

urlpatterns = [
    path("usage-records", views.UsageRecordList.as_view(), name="usagerecord-list"),
    path("usage-records/<int:pk>", views.UsageRecordDetail.as_view(), name="usagerecord-detail"),
    path("usage-records/<int:pk>/reconcile", views.UsageRecordReconcile.as_view(), name="usagerecord-reconcile"),
    path("usage-records/<int:pk>/resolve", views.UsageRecordResolve.as_view(), name="usagerecord-resolve"),
    path("statements", views.StatementList.as_view(), name="statement-list"),
    path("statements/<int:pk>", views.StatementDetail.as_view(), name="statement-detail"),
    path("statements/<int:pk>/finalize", views.StatementFinalize.as_view(), name="statement-finalize"),
    path("statements/<int:pk>/export.<str:kind>", views.StatementExport.as_view(), name="statement-export"),
    path("pool-prices", views.PoolPriceList.as_view(), name="poolprice-list"),
    path("pools/<slug:name>/settlement", views.PoolSettlementView.as_view(), name="pool-settlement"),
    path("owner-settings/<str:username>", views.OwnerSettingsView.as_view(), name="owner-settings"),
    path("quarantine-guidance", views.QuarantineGuidanceList.as_view(), name="quarantine-guidance"),
    path("quarantine-guidance/<str:rule>", views.QuarantineGuidanceView.as_view(), name="quarantine-guidance-rule"),
    path("nodes/<uuid:pk>/quarantine-status", views.NodeQuarantineStatus.as_view(), name="node-quarantine-status"),
    path("appeals", views.AppealList.as_view(), name="appeal-list"),
    path("appeals/<int:pk>", views.AppealDetail.as_view(), name="appeal-detail"),
    path("appeals/<int:pk>/resolve", views.AppealResolve.as_view(), name="appeal-resolve"),
    path("appeals/<int:pk>/withdraw", views.AppealWithdraw.as_view(), name="appeal-withdraw"),
    path("owned-leases", views.OwnedLeaseList.as_view(), name="ownedlease-list"),
    path("owned-leases/<uuid:pk>", views.OwnedLeaseDetail.as_view(), name="ownedlease-detail"),
]
