from django.urls import path
from rest_framework.routers import SimpleRouter

from .. import upgrades
from . import views

router = SimpleRouter(trailing_slash=False)
router.register("upgrades", views.UpgradeViewSet, basename="upgrade")
router.register("scale-decisions", views.ScaleDecisionViewSet, basename="scaledecision")
router.register("machines", views.MachineViewSet, basename="machine")

urlpatterns = [
    path("upgrades/dry-run", views.UpgradeDryRunView.as_view(), name="upgrade-dry-run"),
    path("upgrades/<uuid:pk>/dry-run", views.UpgradePlanView.as_view(), name="upgrade-dry-run-detail"),
    path("upgrades/<uuid:pk>/start", views.action_view(upgrades.upgrade_start), name="upgrade-start"),
    path("upgrades/<uuid:pk>/pause", views.action_view(upgrades.upgrade_pause), name="upgrade-pause"),
    path("upgrades/<uuid:pk>/resume", views.UpgradeResumeView.as_view(), name="upgrade-resume"),
    path("upgrades/<uuid:pk>/rollback", views.action_view(upgrades.upgrade_rollback), name="upgrade-rollback"),
    path("upgrades/<uuid:pk>/abort", views.action_view(upgrades.upgrade_abort), name="upgrade-abort"),
    path("pools/<slug:name>/operations", views.PoolOperationsView.as_view(), name="pool-operations"),
    path("pools/<slug:name>/disruptions", views.PoolDisruptionsView.as_view(), name="pool-disruptions"),
    path("pools/<slug:name>/replacements", views.PoolReplacementsView.as_view(), name="pool-replacements"),
    path("pools/<slug:name>/repairs", views.PoolRepairsView.as_view(), name="pool-repairs"),
    path("nodes/<uuid:pk>/disruption", views.NodeDisruptionView.as_view(), name="node-disruption"),
    path("pools/<slug:name>/preemptions", views.PoolPreemptionsView.as_view(), name="pool-preemptions"),
    path(
        "pools/<slug:name>/preemption-notices", views.PoolPreemptionNoticeView.as_view(), name="pool-preemption-notice"
    ),
    path("nodes/bulk/cordon", views.bulk_view("cordon"), name="nodes-bulk-cordon"),
    path("nodes/bulk/uncordon", views.bulk_view("uncordon"), name="nodes-bulk-uncordon"),
    path("nodes/bulk/drain", views.bulk_view("drain"), name="nodes-bulk-drain"),
    path("nodes/<uuid:pk>/shutdown-drain", views.NodeShutdownDrainView.as_view(), name="node-shutdown-drain"),
    path("nodes/<uuid:pk>/preemption-notice", views.NodePreemptionNoticeView.as_view(), name="node-preemption-notice"),
    *router.urls,
]
