"""Marketplace URLs under /api/v1/ (docs/api-contract.md, "Marketplace")."""

from django.urls import path

from . import money_views as money
from . import settings_views, views

urlpatterns = [
    path("usage-records", views.UsageRecordList.as_view(), name="usagerecord-list"),
    path("usage-records/<int:pk>", views.UsageRecordDetail.as_view(), name="usagerecord-detail"),
    path("usage-records/<int:pk>/reconcile", views.UsageRecordReconcile.as_view(), name="usagerecord-reconcile"),
    path("usage-records/<int:pk>/resolve", views.UsageRecordResolve.as_view(), name="usagerecord-resolve"),
    path("statements", views.StatementList.as_view(), name="statement-list"),
    path("statements/<int:pk>", views.StatementDetail.as_view(), name="statement-detail"),
    path("statements/<int:pk>/finalize", views.StatementFinalize.as_view(), name="statement-finalize"),
    path("statements/<int:pk>/export.<str:kind>", views.StatementExport.as_view(), name="statement-export"),
    path("pool-prices", settings_views.PoolPriceList.as_view(), name="poolprice-list"),
    path("pools/<slug:name>/settlement", settings_views.PoolSettlementView.as_view(), name="pool-settlement"),
    path("owner-settings/<str:username>", settings_views.OwnerSettingsView.as_view(), name="owner-settings"),
    path("quarantine-guidance", settings_views.QuarantineGuidanceList.as_view(), name="quarantine-guidance"),
    path(
        "quarantine-guidance/<str:rule>",
        settings_views.QuarantineGuidanceView.as_view(),
        name="quarantine-guidance-rule",
    ),
    path("nodes/<uuid:pk>/quarantine-status", views.NodeQuarantineStatus.as_view(), name="node-quarantine-status"),
    path("appeals", views.AppealList.as_view(), name="appeal-list"),
    path("appeals/<int:pk>", views.AppealDetail.as_view(), name="appeal-detail"),
    path("appeals/<int:pk>/resolve", views.AppealResolve.as_view(), name="appeal-resolve"),
    path("appeals/<int:pk>/withdraw", views.AppealWithdraw.as_view(), name="appeal-withdraw"),
    path("owned-leases", views.OwnedLeaseList.as_view(), name="ownedlease-list"),
    path("owned-leases/<uuid:pk>", views.OwnedLeaseDetail.as_view(), name="ownedlease-detail"),
    path("pool-periods", money.PoolPeriodList.as_view(), name="poolperiod-list"),
    path("pool-periods/<int:pk>", money.PoolPeriodDetail.as_view(), name="poolperiod-detail"),
    path("pool-periods/<int:pk>/reconcile", money.PoolPeriodReconcile.as_view(), name="poolperiod-reconcile"),
    path("mismatch-items", money.MismatchItemList.as_view(), name="mismatchitem-list"),
    path("mismatch-items/<int:pk>/resolve", money.MismatchItemResolve.as_view(), name="mismatchitem-resolve"),
    path("payouts", money.PayoutList.as_view(), name="payout-list"),
    path("payouts/import", money.PayoutImport.as_view(), name="payout-import"),
    path("payouts/export.<str:kind>", money.PayoutExport.as_view(), name="payout-export"),
    path("payouts/<int:pk>", money.PayoutDetail.as_view(), name="payout-detail"),
    path("payouts/<int:pk>/approve", money.PayoutAction.as_view(action="approve"), name="payout-approve"),
    path("payouts/<int:pk>/paid", money.PayoutAction.as_view(action="paid"), name="payout-paid"),
    path("payouts/<int:pk>/failed", money.PayoutAction.as_view(action="failed"), name="payout-failed"),
    path("payouts/<int:pk>/reverse", money.PayoutAction.as_view(action="reverse"), name="payout-reverse"),
    path("payout-holds", money.PayoutHoldList.as_view(), name="payouthold-list"),
    path("payout-holds/<int:pk>/release", money.PayoutHoldRelease.as_view(), name="payouthold-release"),
    path("line-appeals", money.LineAppealList.as_view(), name="lineappeal-list"),
    path("line-appeals/<int:pk>/resolve", money.LineAppealResolve.as_view(), name="lineappeal-resolve"),
    path("line-appeals/<int:pk>/withdraw", money.LineAppealWithdraw.as_view(), name="lineappeal-withdraw"),
]
