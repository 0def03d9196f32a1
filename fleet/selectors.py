"""Read-side queries over nodes. ``schedulable`` is derived here and nowhere else."""

from __future__ import annotations

from django.db.models import Exists, OuterRef, Prefetch, Q, QuerySet
from django.utils import timezone

from nodepool.api.permissions import is_client, is_operator, is_owner

from .choices import BenchmarkStatus, Health, Lifecycle, Liveness
from .models import AdmissionCheck, Benchmark, Node, NodeCredential, NodeEvent

# Stable reason codes for why a node is not schedulable (used by the API and the scheduler).
NOT_READY_LIFECYCLE = "lifecycle_not_ready"
NOT_ALIVE = "not_alive"
NODE_NOT_READY = "node_not_ready"
UNHEALTHY = "unhealthy"
NO_VALID_CREDENTIAL = "no_valid_credential"

SCHEDULABLE_HEALTH = (Health.HEALTHY, Health.DEGRADED)
RECENT_EVENTS = 10
RECENT_CREDENTIALS = 5


def valid_credential_exists(now=None) -> Exists:
    now = now or timezone.now()
    return Exists(NodeCredential.objects.filter(node=OuterRef("pk"), revoked_at__isnull=True, expires_at__gt=now))


def schedulable_q(now=None) -> Q:
    """A ``Q`` for nodes that may receive new work (use with :func:`valid_credential_exists`).

    Schedulable = lifecycle ``ready`` and liveness ``alive`` and readiness true and health within
    pool policy (``healthy`` or ``degraded``) and a valid credential (DESIGN.md, the state model).
    """
    return Q(
        lifecycle=Lifecycle.READY,
        liveness=Liveness.ALIVE,
        ready=True,
        health__in=SCHEDULABLE_HEALTH,
        has_valid_credential=True,
    )


def schedulable_nodes(now=None) -> QuerySet[Node]:
    return Node.objects.annotate(has_valid_credential=valid_credential_exists(now)).filter(schedulable_q(now))


def unschedulable_reasons(node: Node, *, has_valid_credential: bool | None = None, now=None) -> list[dict]:
    """Why ``node`` cannot take new work: ``[{"code", "message"}]``; empty when schedulable."""
    if has_valid_credential is None:
        has_valid_credential = getattr(node, "has_valid_credential", None)
    if has_valid_credential is None:
        now = now or timezone.now()
        has_valid_credential = NodeCredential.objects.filter(
            node=node, revoked_at__isnull=True, expires_at__gt=now
        ).exists()
    reasons = []
    if node.lifecycle != Lifecycle.READY:
        reasons.append({"code": NOT_READY_LIFECYCLE, "message": f"lifecycle is {node.lifecycle}"})
    if node.liveness != Liveness.ALIVE:
        reasons.append({"code": NOT_ALIVE, "message": f"liveness is {node.liveness}"})
    if not node.ready:
        reasons.append({"code": NODE_NOT_READY, "message": node.ready_reason or "the node reports not ready"})
    if node.health not in SCHEDULABLE_HEALTH:
        detail = ", ".join(node.health_reasons or []) or node.health
        reasons.append({"code": UNHEALTHY, "message": f"health is {node.health} ({detail})"})
    if not has_valid_credential:
        reasons.append({"code": NO_VALID_CREDENTIAL, "message": "no valid node credential"})
    return reasons


def pending_benchmark(node: Node, *, now=None):
    """The benchmark ``node`` should run now (status ``requested``, deadline ahead), or None.

    Heartbeat responses put it in ``instructions.run_benchmark`` as ``{"nonce", "deadline"}``.
    """
    now = now or timezone.now()
    pending = Benchmark.objects.filter(node=node, status=BenchmarkStatus.REQUESTED, deadline__gt=now)
    return pending.order_by("-requested_at").first()


def node_queryset_for(user, *, now=None) -> QuerySet[Node]:
    """Nodes ``user`` may see, with everything the node API renders loaded in a constant number of queries.

    Operators and lease clients see every node; marketplace owners only their own (any lifecycle,
    quarantined and rejected included); anyone else nothing.
    """
    qs = (
        Node.objects.select_related("pool", "owner", "bootstrap_token")
        .annotate(has_valid_credential=valid_credential_exists(now))
        .prefetch_related(
            "resources",
            Prefetch("admission_checks", queryset=AdmissionCheck.objects.order_by("attempt", "id")),
            # Sliced prefetches (one window-function query each) need to_attr.
            Prefetch(
                "events",
                queryset=NodeEvent.objects.order_by("-created_at", "-id")[:RECENT_EVENTS],
                to_attr="recent_events",
            ),
            Prefetch(
                "credentials",
                queryset=NodeCredential.objects.order_by("-issued_at")[:RECENT_CREDENTIALS],
                to_attr="recent_credentials",
            ),
        )
    )
    if is_operator(user) or is_client(user):
        return qs
    if is_owner(user):
        return qs.filter(owner=user)
    return qs.none()
