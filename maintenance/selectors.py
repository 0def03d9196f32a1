"""Read-side queries for maintenance: allowed actions, drains and quarantines visible to a user."""

from __future__ import annotations

from django.db.models import QuerySet

from fleet.models import Node
from nodepool.api.permissions import is_operator

from .models import DisruptionBudget, Drain, Quarantine

# FSM transition name -> the operator action (URL verb) that runs it. ``admit``, ``reject`` and
# ``complete_drain`` are left out: the control plane runs them, not an operator.
OPERATOR_ACTIONS = {
    "start_admission": "admit",
    "cordon": "cordon",
    "uncordon": "uncordon",
    "drain": "drain",
    "cancel_drain": "cancel-drain",
    "return_to_service": "return-to-service",
    "quarantine": "quarantine",
    "release": "release",
    "retire": "retire",
}
_ORDER = list(OPERATOR_ACTIONS.values())


def allowed_actions(node: Node) -> list[str]:
    """The operator actions the node's current lifecycle allows (django-fsm's available transitions).

    ``cancel-drain`` is ``POST /api/v1/drains/{id}/cancel``; the others are ``POST /nodes/{id}/<action>``.
    """
    names = {t.name for t in node.get_available_lifecycle_transitions()}
    actions = {OPERATOR_ACTIONS[name] for name in names if name in OPERATOR_ACTIONS}
    return sorted(actions, key=_ORDER.index)


def drains_for(user) -> QuerySet[Drain]:
    """Drains ``user`` may read: operators all, owners those of their own nodes, others none."""
    qs = Drain.objects.select_related("node", "node__pool", "requested_by")
    if is_operator(user):
        return qs
    return qs.filter(node__owner=user) if user.is_authenticated else qs.none()


def quarantines_for(user) -> QuerySet[Quarantine]:
    """Quarantines ``user`` may read: operators all, owners their own nodes' (with reason and evidence)."""
    qs = Quarantine.objects.select_related("node", "node__pool")
    if is_operator(user):
        return qs
    return qs.filter(node__owner=user) if user.is_authenticated else qs.none()


def active_drain(node: Node) -> Drain | None:
    return Drain.objects.filter(node=node, state="active").first()


def budgets() -> QuerySet[DisruptionBudget]:
    return DisruptionBudget.objects.all()
