"""Read-side queries over nodes. ``schedulable`` is derived here and nowhere else."""

from __future__ import annotations

from django.db.models import (
    BooleanField,
    Case,
    CharField,
    Count,
    Exists,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Sum,
    TextField,
    Value,
    When,
)
from django.db.models.functions import Cast, Greatest
from django.db.models.lookups import Contains
from django.utils import timezone

from nodepool.api.permissions import is_client, is_operator, is_owner

from . import health
from .choices import BenchmarkStatus, Health, Lifecycle, Liveness
from .devices import counted, held_for_itself, normalise_model
from .models import AdmissionCheck, Benchmark, Device, Node, NodeCredential, NodeEvent, NodeHold, NodeResource

# Stable reason codes for why a node is not schedulable (used by the API and the scheduler).
NOT_READY_LIFECYCLE = "lifecycle_not_ready"
CORDONED = "cordoned"
NOT_ALIVE = "not_alive"
NODE_NOT_READY = "node_not_ready"
READY_CONDITION_FALSE = "ready_condition_false"
READY_CONDITION_UNKNOWN = "ready_condition_unknown"
UNHEALTHY = "unhealthy"
NO_VALID_CREDENTIAL = "no_valid_credential"
STATUS_REPORT_OVERDUE = "status_report_overdue"

SCHEDULABLE_HEALTH = (Health.HEALTHY, Health.DEGRADED)
RECENT_EVENTS = 10
RECENT_CREDENTIALS = 5


def valid_credential_exists(now=None) -> Exists:
    now = now or timezone.now()
    return Exists(NodeCredential.objects.filter(node=OuterRef("pk"), revoked_at__isnull=True, expires_at__gt=now))


def schedulable_q(now=None) -> Q:
    """A ``Q`` for nodes that may receive new work (use with :func:`valid_credential_exists`).

    Schedulable = lifecycle ``ready`` and no cordon hold and liveness ``alive`` and readiness true and health within
    pool policy (``healthy`` or ``degraded``) and a valid credential (docs/foundation.md, "The state model"),
    and a status report not overdue (its readiness and health are not stale news).
    """
    return Q(
        lifecycle=Lifecycle.READY,
        cordoned=False,
        liveness=Liveness.ALIVE,
        ready=True,
        health__in=SCHEDULABLE_HEALTH,
        status_report_overdue=False,
        has_valid_credential=True,
    )


# Each unschedulable reason as a query over nodes annotated with ``has_valid_credential``; the
# same conditions as :func:`unschedulable_reasons`, so a filter and the reasons shown agree.
# The Ready condition's own codes (False/Unknown) fall under "unhealthy" here: their health is
# unhealthy, and a JSON condition list is no column to filter on, alike on SQLite and PostgreSQL.
UNSCHEDULABLE_REASON_LABELS = {
    NOT_READY_LIFECYCLE: "lifecycle not ready",
    CORDONED: "cordoned (a hold)",
    NOT_ALIVE: "not alive",
    NODE_NOT_READY: "node reports not ready",
    UNHEALTHY: "unhealthy (Ready condition included)",
    NO_VALID_CREDENTIAL: "no valid credential",
    STATUS_REPORT_OVERDUE: "status report overdue",
}


def unschedulable_reason_q(code: str) -> Q:
    """A ``Q`` for nodes that have unschedulable reason ``code`` (one of ``UNSCHEDULABLE_REASON_LABELS``).

    Raises:
        KeyError: ``code`` is not a known reason code.
    """
    return {
        NOT_READY_LIFECYCLE: ~Q(lifecycle=Lifecycle.READY),
        CORDONED: Q(cordoned=True),
        NOT_ALIVE: ~Q(liveness=Liveness.ALIVE),
        NODE_NOT_READY: Q(ready=False),
        UNHEALTHY: ~Q(health__in=SCHEDULABLE_HEALTH),
        NO_VALID_CREDENTIAL: Q(has_valid_credential=False),
        STATUS_REPORT_OVERDUE: Q(status_report_overdue=True),
    }[code]


def first_unschedulable_reason() -> Case:
    """SQL for the first code :func:`unschedulable_reasons` gives a node, ``""`` when it is schedulable.

    For querysets of nodes annotated (or aliased) with ``has_valid_credential``; group by it to
    count nodes per reason in one query (the 409 explanation does). The order is
    :func:`unschedulable_reasons`' own. The Ready condition's codes are read from
    ``health_reasons``, which holds ``"Ready=False (…)"`` / ``"Ready=Unknown"`` whenever the
    condition has that status (``fleet.health.evaluate``); both statuses make health unschedulable.
    """
    health_bad = ~Q(health__in=SCHEDULABLE_HEALTH)
    reasons_text = Cast("health_reasons", TextField())
    ready_false = health_bad & Contains(reasons_text, f'"{health.READY}={health.FALSE}')
    ready_unknown = health_bad & Contains(reasons_text, f'"{health.READY}={health.UNKNOWN}')
    return Case(
        When(unschedulable_reason_q(NOT_READY_LIFECYCLE), then=Value(NOT_READY_LIFECYCLE)),
        When(unschedulable_reason_q(CORDONED), then=Value(CORDONED)),
        When(unschedulable_reason_q(NOT_ALIVE), then=Value(NOT_ALIVE)),
        When(unschedulable_reason_q(NODE_NOT_READY), then=Value(NODE_NOT_READY)),
        When(ready_false, then=Value(READY_CONDITION_FALSE)),
        When(ready_unknown, then=Value(READY_CONDITION_UNKNOWN)),
        When(health_bad, then=Value(UNHEALTHY)),
        When(unschedulable_reason_q(STATUS_REPORT_OVERDUE), then=Value(STATUS_REPORT_OVERDUE)),
        When(unschedulable_reason_q(NO_VALID_CREDENTIAL), then=Value(NO_VALID_CREDENTIAL)),
        default=Value(""),
        output_field=CharField(),
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
    if getattr(node, "cordoned", False):
        holds = getattr(node, "prefetched_active_holds", None)
        owners = ", ".join(f"{h.owner} ({h.reason})" if h.reason else h.owner for h in holds or [])
        reasons.append({"code": CORDONED, "message": f"cordoned by {owners}" if owners else "cordoned"})
    if node.liveness != Liveness.ALIVE:
        reasons.append({"code": NOT_ALIVE, "message": f"liveness is {node.liveness}"})
    if not node.ready:
        reasons.append({"code": NODE_NOT_READY, "message": node.ready_reason or "the node reports not ready"})
    ready = health.ready_status(getattr(node, "conditions", None))
    if ready == health.FALSE:
        reasons.append({"code": READY_CONDITION_FALSE, "message": "the node's Ready condition is False"})
    elif ready == health.UNKNOWN:
        reasons.append({"code": READY_CONDITION_UNKNOWN, "message": "the node's Ready condition is Unknown"})
    # Health reasons other than the Ready condition (which has its own code above).
    others = [r for r in node.health_reasons or [] if not r.startswith(f"{health.READY}=")]
    if node.health not in SCHEDULABLE_HEALTH and (others or ready not in (health.FALSE, health.UNKNOWN)):
        detail = ", ".join(others) or node.health
        reasons.append({"code": UNHEALTHY, "message": f"health is {node.health} ({detail})"})
    if node.status_report_overdue:
        reasons.append(
            {"code": STATUS_REPORT_OVERDUE, "message": "no status report for over two status-report intervals"}
        )
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
                "holds",
                queryset=NodeHold.objects.filter(removed_at__isnull=True).order_by("created_at", "pk"),
                to_attr="prefetched_active_holds",
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


# Lifecycles whose nodes count as capacity the pool has (admitted and not taken out for good).
# A cordoned node is a ready node with a hold: it stays in service (its leases keep running).
IN_SERVICE_LIFECYCLES = (Lifecycle.READY, Lifecycle.DRAINING)


def pool_devices(pool, schedulable_ids) -> dict:
    """``{type: {model: {"total", "allocatable", "allocated", "free", "health": {state: n}}}}``:
    the live devices of ``pool``'s in-service nodes, the model normalised to a known list or
    ``other`` (self-reported models are not trusted to be few). ``allocated``: held by a live
    lease for itself (whatever its health now); ``allocatable``: verified, healthy, untainted, not
    held out and not taken by a relative (fleet.devices.counted: a GPU and its MIG instances
    exclude each other); ``free``: allocatable, nobody's (not ``claimed``), on a schedulable node.
    Each count is a count of rows, so none is ever negative: a device that fails while allocated
    is ``allocated`` and no longer ``allocatable``, and free stays what is really free. One grouped
    query."""
    grouped = (
        Device.objects.filter(node__pool=pool, node__lifecycle__in=IN_SERVICE_LIFECYCLES, retired_at__isnull=True)
        .annotate(
            usable=ExpressionWrapper(counted(), output_field=BooleanField()),
            taken=held_for_itself(),
            open=ExpressionWrapper(Q(node_id__in=schedulable_ids), output_field=BooleanField()),
        )
        .values_list("type", "model", "health", "usable", "taken", "claimed", "open")
        .annotate(n=Count("pk"))
        .order_by()
    )
    out: dict = {}
    for kind, model, state, usable_, taken, claimed, open_, n in grouped:
        entry = out.setdefault(kind, {}).setdefault(
            normalise_model(model), {"total": 0, "allocatable": 0, "allocated": 0, "free": 0, "health": {}}
        )
        entry["total"] += n
        entry["health"][state] = entry["health"].get(state, 0) + n
        entry["allocatable"] += n if usable_ else 0
        entry["allocated"] += n if taken else 0
        entry["free"] += n if usable_ and not claimed and open_ else 0
    return out


def pool_capacity(pool, *, now=None) -> dict:
    """Capacity and node counts of one pool, in canonical units (cpu millicores, bytes, counts).

    Returns ``{"resources": {name: {"allocatable", "allocated", "free", "largest_free_block"}},
    "devices": {type: {model: {"total", "allocatable", "allocated", "free", "health": {state: n}}}},
    "nodes": {"total", "schedulable", "ready", "in_service", "lifecycle": {state: n}, "liveness":
    {...}, "health": {...}}, "ready_ratio": float | None}``.

    ``allocatable``/``allocated`` sum the in-service nodes (lifecycle ready — cordoned or not — or draining);
    ``free`` and ``largest_free_block`` count schedulable nodes only (what a new lease could use);
    a ``largest_free_block`` well below ``free`` means the pool is fragmented. ``ready_ratio`` is
    the Node Ready SLI: in-service nodes that are alive and report ready, over in-service nodes.
    ``devices`` (:func:`pool_devices`) counts the in-service nodes' live devices by type and
    model (normalised: :func:`fleet.devices.normalise_model`). Six aggregate queries whatever the
    pool's size.
    """
    nodes = Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED)
    counts: dict = {"lifecycle": {}, "liveness": {}, "health": {}}
    total = 0
    for dimension in ("lifecycle", "liveness", "health"):
        for value, n in nodes.values_list(dimension).annotate(n=Count("id")).order_by(dimension):
            counts[dimension][value] = n
            total += n if dimension == "lifecycle" else 0
    in_service = nodes.filter(lifecycle__in=IN_SERVICE_LIFECYCLES)
    ready = in_service.filter(liveness=Liveness.ALIVE, ready=True).count()
    n_in_service = sum(counts["lifecycle"].get(state, 0) for state in IN_SERVICE_LIFECYCLES)
    schedulable_ids = schedulable_nodes(now).filter(pool=pool).values("pk")
    resources: dict[str, dict] = {}
    for name, allocatable, allocated in (
        NodeResource.objects.filter(node__pool=pool, node__lifecycle__in=IN_SERVICE_LIFECYCLES)
        .values_list("name")
        .annotate(Sum("allocatable"), Sum("allocated"))
        .order_by("name")
    ):
        resources[name] = {"allocatable": allocatable, "allocated": allocated, "free": 0, "largest_free_block": 0}
    for name, free, largest in (
        NodeResource.objects.filter(node__in=schedulable_ids)
        .annotate(free=Greatest(F("allocatable") - F("allocated"), 0))
        .values_list("name")
        .annotate(Sum("free"), Max("free"))
        .order_by("name")
    ):
        entry = resources.setdefault(name, {"allocatable": 0, "allocated": 0, "free": 0, "largest_free_block": 0})
        entry["free"], entry["largest_free_block"] = free or 0, largest or 0
    schedulable = schedulable_nodes(now).filter(pool=pool).count()
    return {
        "resources": resources,
        "devices": pool_devices(pool, schedulable_ids),
        "nodes": {"total": total, "schedulable": schedulable, "ready": ready, "in_service": n_in_service, **counts},
        "ready_ratio": round(ready / n_in_service, 6) if n_in_service else None,
    }
