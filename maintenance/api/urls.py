from django.urls import path
from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter(trailing_slash=False)
router.register("drains", views.DrainViewSet, basename="drain")
router.register("quarantines", views.QuarantineViewSet, basename="quarantine")
router.register("disruption-budgets", views.DisruptionBudgetViewSet, basename="disruptionbudget")

urlpatterns = [
    path("nodes/<uuid:pk>/cordon", views.CordonView.as_view(), name="node-cordon"),
    path("nodes/<uuid:pk>/uncordon", views.UncordonView.as_view(), name="node-uncordon"),
    path("nodes/<uuid:pk>/drain", views.DrainView.as_view(), name="node-drain"),
    path("nodes/<uuid:pk>/quarantine", views.QuarantineView.as_view(), name="node-quarantine"),
    path("nodes/<uuid:pk>/release", views.ReleaseView.as_view(), name="node-release"),
    path("nodes/<uuid:pk>/return-to-service", views.ReturnToServiceView.as_view(), name="node-return-to-service"),
    path("nodes/<uuid:pk>/retire", views.RetireView.as_view(), name="node-retire"),
    path("nodes/<uuid:pk>/repair-drain", views.RepairDrainView.as_view(), name="node-repair-drain"),
    path("drains/<uuid:pk>/cancel", views.DrainCancelView.as_view(), name="drain-cancel"),
    path("drains/<uuid:pk>/deadline", views.DrainDeadlineView.as_view(), name="drain-deadline"),
    *router.urls,
]
