"""Read-side queries for maintenance: allowed actions, drains and quarantines visible to a user."""

from __future__ import annotations

from django.db.models import QuerySet

from fleet.choices import Lifecycle
from fleet.models import Node
from nodepool.api.permissions import is_operator

from .models import DisruptionBudget, Drain, Quarantine

# FSM transition name -> the operator action (URL verb) that runs it. ``admit``, ``reject`` and
# ``complete_drain`` are left out: the control plane runs them, not an operator.
OPERATOR_ACTIONS = {
    "start_admission": "admit",
    "drain": "drain",
    "cancel_drain": "cancel-drain",
    "return_to_service": "return-to-service",
    "quarantine": "quarantine",
    "release": "release",
    "retire": "retire",
}
_ORDER = ["admit", "cordon", "uncordon", "drain", "cancel-drain", "repair-drain", *list(OPERATOR_ACTIONS.values())[3:]]


def allowed_actions(node: Node) -> list[str]:
    """The operator actions the node allows now: its lifecycle's transitions (django-fsm) plus
    ``cordon`` (any node but a retired one) and ``uncordon`` (while it has holds).

    ``cancel-drain`` is ``POST /api/v1/drains/{id}/cancel``; the others are ``POST /nodes/{id}/<action>``.
    A draining node with no active drain offers ``repair-drain`` instead of ``cancel-drain``.
    """
    names = {t.name for t in node.get_available_lifecycle_transitions()}
    actions = {OPERATOR_ACTIONS[name] for name in names if name in OPERATOR_ACTIONS}
    if node.lifecycle != Lifecycle.RETIRED:
        actions.add("cordon")
        if node.cordoned:
            actions.add("uncordon")
    if "cancel-drain" in actions and not Drain.objects.filter(node=node, state="active").exists():
        # Draining with no drain to cancel (the state the old admin's delete could leave): repair it.
        actions.discard("cancel-drain")
        actions.add("repair-drain")
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


PRIVATE_EVIDENCE_KEY = "private"
PRIVATE_KEYS_KEY = "private_keys"


def public_evidence(evidence) -> dict:
    """A quarantine's evidence as its node's owner may read it: without what operators marked
    private, i.e. the ``"private"`` member (an object of operator-only notes) and every top-level
    member named in ``"private_keys"`` (a list of names). docs/marketplace.md, "The owner's view"."""
    if not isinstance(evidence, dict):
        return {}
    hidden = evidence.get(PRIVATE_KEYS_KEY)
    hidden = {str(name) for name in hidden} if isinstance(hidden, list) else set()
    hidden |= {PRIVATE_EVIDENCE_KEY, PRIVATE_KEYS_KEY}
    return {key: value for key, value in evidence.items() if key not in hidden}


def active_drain(node: Node) -> Drain | None:
    return Drain.objects.filter(node=node, state="active").first()


def budgets() -> QuerySet[DisruptionBudget]:
    return DisruptionBudget.objects.all()
