"""A node's reliability record: uptime, leases completed against leases lost through the node's
fault, faults per device, over rolling windows; and the score ``reliability`` placement compares.

Definitions (docs/fleet.md, "Reliability"):

- **Up** means liveness ``alive`` or ``stale`` (heard within the pool's grace); ``unknown``,
  ``unreachable`` and ``lost`` are down. ``observed_seconds`` counts the node's existence since it
  enrolled; a node that is switched off for maintenance is down (uptime describes the machine as
  clients meet it).
- **Lease outcomes** (:class:`fleet.choices.LeaseOutcome`) are classified when a lease ends, in its
  transaction (leases.reliability), and counted here per node and UTC day
  (:func:`record_lease_outcome`). ``completed``: released by its client. Through the node's fault
  (:data:`fleet.choices.NODE_FAULT_OUTCOMES`): lost while the node was unreachable or lost, lost
  because the live node stopped reporting it, lost because the node restarted and no longer ran
  it, released as failed within ``RELIABILITY_RESTART_WINDOW`` seconds of an unplanned restart,
  revoked by a fault of one of its devices, revoked by the node's quarantine. Everything else
  (expiry, an operator's revoke, drains, preemption) is neither.
- **Re-verification history**: the node's finished scheduled re-verification runs
  (fleet.reverification, issue 32 items 1-2) within the 30-day window, read from their own rows.
- **Score**: ``reliability = completed / (completed + node-fault losses)`` over the last
  ``RELIABILITY_WINDOW_DAYS`` days (30), once that sum reaches ``RELIABILITY_MIN_SAMPLE`` (10).
  Below it the node is **unrated** (``None``): it matches no reliability constraint and is not
  preferred. A prior (say 0.9 for everyone new) would let a fresh machine — or one re-enrolled to
  shed a bad record — pass ``reliability >= 0.9`` on no evidence; Vast.ai shows new hosts
  without a reliability figure for the same reason. Clients that do not ask for reliability
  still place on unrated nodes, which is how they earn a record.

Storage: :class:`fleet.models.NodeReliabilityDay`, one row per node and day, kept
``RELIABILITY_RETENTION_DAYS`` (400), far beyond the event retention (nodepool.retention, 90 days):
the rollup (:func:`rollup`, beat every ``RELIABILITY_ROLLUP_INTERVAL`` s) rewrites today's and
yesterday's uptime and device faults from the events while they exist, then copies each node's
score into ``Node.reliability`` for placement.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from django.db import IntegrityError, transaction
from django.db.models import Count, F, Q, Sum
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from . import conf, event_types
from .choices import NODE_FAULT_OUTCOMES, ActorType, LeaseOutcome, Lifecycle, Liveness, ReverificationState
from .models import Node, NodeEvent, NodeReliabilityDay, Reverification

UP_LIVENESS = frozenset({Liveness.ALIVE, Liveness.STALE})
WINDOWS_DAYS = (7, 30)
# The score's distribution buckets (upper bounds) for /metrics: nodepool_node_reliability{pool,le}.
BUCKETS = (0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
OUTCOME_COLUMNS = {outcome: f"leases_{outcome.value}" for outcome in LeaseOutcome}


def day_of(moment: datetime) -> date:
    """The UTC day of ``moment`` (an aware datetime)."""
    return moment.astimezone(UTC).date()


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


# --- writing -----------------------------------------------------------------------------------
def record_lease_outcome(*, node_id, outcome: str, at: datetime) -> None:
    """Count one ended lease of ``node_id`` under ``outcome`` (a :class:`LeaseOutcome` value) on
    ``at``'s UTC day. Call it inside the transaction that ends the lease, so the count and the end
    commit or roll back together.

    Concurrent ends on the same node and day serialise on the row; the first of two racing
    creates wins and the other increments (a savepoint keeps the caller's transaction usable).

    Raises:
        KeyError: ``outcome`` is not a :class:`LeaseOutcome` value.
    """
    column = OUTCOME_COLUMNS[LeaseOutcome(outcome)]
    day = day_of(at)
    rows = NodeReliabilityDay.objects.filter(node_id=node_id, day=day)
    if rows.update(**{column: F(column) + 1}):
        return
    try:
        with transaction.atomic():
            NodeReliabilityDay.objects.create(node_id=node_id, day=day, **{column: 1})
    except IntegrityError:  # another transaction created the day's row first
        rows.update(**{column: F(column) + 1})


def uptime(*, start: datetime, end: datetime, nodes) -> dict:
    """``{node id: (observed_seconds, up_seconds)}`` over ``[start, end)`` for ``nodes``, an
    iterable of ``(id, created_at, liveness)``.

    Reads the ``liveness`` events from ``start`` on: the state before a node's first event at or
    after ``start`` is that event's ``from_state``; a node with no event since then has been in its
    current liveness the whole time. Exact while the events are within retention (the rollup
    reads only today and yesterday). Seconds are whole (floored).
    """
    events = defaultdict(list)
    for node_id, at, from_state, to_state in (
        NodeEvent.objects.filter(type=event_types.LIVENESS, created_at__gte=start, node__isnull=False)
        .order_by("created_at", "id")
        .values_list("node_id", "created_at", "from_state", "to_state")
    ):
        events[node_id].append((at, from_state, to_state))
    out = {}
    for node_id, created_at, liveness in nodes:
        begin = max(start, created_at)
        if begin >= end:
            continue
        timeline = [e for e in events.get(node_id, ()) if e[0] >= begin]
        state = timeline[0][1] if timeline else liveness
        cursor, up = begin, 0.0
        for at, _, to_state in timeline:
            if at >= end:
                break
            if state in UP_LIVENESS:
                up += (at - cursor).total_seconds()
            state, cursor = to_state, at
        if state in UP_LIVENESS:
            up += (end - cursor).total_seconds()
        out[node_id] = (int((end - begin).total_seconds()), int(up))
    return out


def device_faults(*, start: datetime, end: datetime) -> dict:
    """``{node id: {device id: faults}}`` in ``[start, end)``: ``device`` events that tainted a
    device on the node's own report (fleet.devices: a fatal or reset-needing XID, uncorrectable
    ECC growth, a remapped-rows failure). An operator's taint is a decision, not a fault, and is
    not counted."""
    out: dict = defaultdict(lambda: defaultdict(int))
    for node_id, data in (
        NodeEvent.objects.filter(
            type=event_types.DEVICE, to_state="tainted", created_at__gte=start, created_at__lt=end, node__isnull=False
        )
        .exclude(actor_type=ActorType.USER)
        .values_list("node_id", "data")
    ):
        device_id = (data or {}).get("device_id") if isinstance(data, dict) else None
        if device_id:
            out[node_id][str(device_id)] += 1
    return {node: dict(per_device) for node, per_device in out.items()}


def rollup(*, now: datetime | None = None) -> dict:
    """Rewrite yesterday's and today's uptime and device faults of every non-retired node, prune
    rows older than ``RELIABILITY_RETENTION_DAYS`` and refresh every node's score.

    Safe to run twice at once: it overwrites its own columns with values computed from the same
    events (the lease counters are never touched here). Returns
    ``{"rows": written, "pruned": deleted, "scores_changed": n}``.
    """
    now = now or timezone.now()
    nodes = list(Node.objects.exclude(lifecycle=Lifecycle.RETIRED).values_list("id", "created_at", "liveness"))
    rows = []
    for day in (day_of(now) - timedelta(days=1), day_of(now)):
        start, end = day_bounds(day)
        end = min(end, now)
        faults = device_faults(start=start, end=end)
        for node_id, (observed, up) in uptime(start=start, end=end, nodes=nodes).items():
            rows.append(
                NodeReliabilityDay(
                    node_id=node_id,
                    day=day,
                    observed_seconds=observed,
                    up_seconds=up,
                    device_faults=faults.get(node_id, {}),
                )
            )
    NodeReliabilityDay.objects.bulk_create(
        rows,
        batch_size=500,
        update_conflicts=True,
        unique_fields=["node", "day"],
        update_fields=["observed_seconds", "up_seconds", "device_faults", "updated_at"],
    )
    cutoff = day_of(now) - timedelta(days=conf.get("RELIABILITY_RETENTION_DAYS"))
    pruned, _ = NodeReliabilityDay.objects.filter(day__lt=cutoff).delete()
    return {"rows": len(rows), "pruned": pruned, "scores_changed": refresh_scores(now=now)}


# --- reading -----------------------------------------------------------------------------------
def score(completed: int, node_faults: int) -> float | None:
    """``completed / (completed + node_faults)``, or None (unrated) below ``RELIABILITY_MIN_SAMPLE``
    counted leases. Rounded to 4 decimals, so that a stored score compares as written."""
    counted = completed + node_faults
    if counted < max(1, conf.get("RELIABILITY_MIN_SAMPLE")):
        return None
    return round(completed / counted, 4)


def _window_sums(queryset):
    fields = ["observed_seconds", "up_seconds", *OUTCOME_COLUMNS.values()]
    return queryset.annotate(**{f"s_{name}": Sum(name) for name in fields})


def refresh_scores(*, now: datetime | None = None) -> int:
    """Recompute every node's score over the last ``RELIABILITY_WINDOW_DAYS`` and store the ones
    that changed in ``Node.reliability`` (one grouped read, then updates in batches). Returns how
    many changed."""
    now = now or timezone.now()
    since = day_of(now) - timedelta(days=conf.get("RELIABILITY_WINDOW_DAYS") - 1)
    fault_columns = [OUTCOME_COLUMNS[o] for o in NODE_FAULT_OUTCOMES]
    sums = {
        row["node_id"]: score(row["s_leases_completed"] or 0, sum(row[f"s_{c}"] or 0 for c in fault_columns))
        for row in _window_sums(NodeReliabilityDay.objects.filter(day__gte=since).values("node_id")).order_by()
    }
    changed = []
    for node_id, current in Node.objects.values_list("id", "reliability"):
        new = sums.get(node_id)
        if new != current:
            changed.append(Node(pk=node_id, reliability=new))
    # bulk_update sets only this column: the node's version and lifecycle are not touched (the
    # score is derived, not operator state).
    Node.objects.bulk_update(changed, ["reliability"], batch_size=500)
    return len(changed)


@dataclass(frozen=True)
class Window:
    days: int
    observed_seconds: int
    up_seconds: int
    leases: dict[str, int]

    @property
    def uptime(self) -> float | None:
        return round(self.up_seconds / self.observed_seconds, 4) if self.observed_seconds else None

    @property
    def node_faults(self) -> int:
        return sum(self.leases[o.value] for o in NODE_FAULT_OUTCOMES)

    def as_dict(self) -> dict:
        return {
            "days": self.days,
            "uptime": self.uptime,
            "observed_seconds": self.observed_seconds,
            "up_seconds": self.up_seconds,
            "leases_completed": self.leases[LeaseOutcome.COMPLETED.value],
            "leases_node_fault": self.node_faults,
            "leases_node_fault_by_cause": {o.value: self.leases[o.value] for o in NODE_FAULT_OUTCOMES},
            "reliability": score(self.leases[LeaseOutcome.COMPLETED.value], self.node_faults),
        }


REVERIFICATIONS_SHOWN = 20  # the newest runs listed per node (counts cover the whole window)


def reverification_history(node_ids, *, since: datetime) -> dict:
    """``{node id: [{"finished_at", "state" (passed | failed), "code"}]}``: the finished scheduled
    re-verification runs (fleet.reverification) since ``since``, newest first, at most
    :data:`REVERIFICATIONS_SHOWN` each. Outcome and code only: the evidence stays with the owner
    and operators (``GET /nodes/{id}/verification``). One query."""
    out: dict = defaultdict(list)
    for node_id, finished_at, state, code in (
        Reverification.objects.filter(
            node_id__in=list(node_ids),
            state__in=[ReverificationState.PASSED, ReverificationState.FAILED],
            finished_at__gte=since,
        )
        .order_by("-finished_at", "-id")
        .values_list("node_id", "finished_at", "state", "code")
    ):
        out[node_id].append({"finished_at": finished_at, "state": state, "code": code})
    return out


def record(node: Node, *, now: datetime | None = None) -> dict:
    """The node's reliability record (node API, ``nodepoolctl describe node``, the admin node page,
    the marketplace owner view)::

        {"reliability": 0.9876 | null, "rated": bool, "min_sample": 10, "window_days": 30,
         "windows": {"7d": {"days", "uptime" (0-1 | null), "observed_seconds", "up_seconds",
                            "leases_completed", "leases_node_fault",
                            "leases_node_fault_by_cause": {cause: n}, "reliability"},
                     "30d": {...}},
         "device_faults": {device id: faults in the 30-day window},
         "reverifications": {"passed": n, "failed": n (30 days),
                             "runs": [{"finished_at", "state", "code"}] (newest first, at most 20)}}

    ``reliability`` is the stored score placement compares (refreshed by the rollup); the windows
    are summed now from the daily rows. Two queries (:func:`records`: the same for many nodes).
    """
    return records([node], now=now)[node.pk]


def records(nodes, *, now: datetime | None = None) -> dict:
    """``{node pk: record}`` (:func:`record`) for ``nodes`` in two queries: a page of the node list."""
    now = now or timezone.now()
    longest = max(WINDOWS_DAYS)
    first = day_of(now) - timedelta(days=longest - 1)
    ids = [n.pk for n in nodes]
    days = defaultdict(list)
    for row in NodeReliabilityDay.objects.filter(node__in=ids, day__gte=first).values(
        "node_id", "day", "observed_seconds", "up_seconds", "device_faults", *OUTCOME_COLUMNS.values()
    ):
        days[row["node_id"]].append(row)
    runs = reverification_history(ids, since=day_bounds(first)[0])
    return {node.pk: _record(node, days.get(node.pk, []), runs.get(node.pk, []), now=now) for node in nodes}


def _record(node: Node, days: list[dict], runs: list[dict], *, now: datetime) -> dict:
    windows = {}
    for length in WINDOWS_DAYS:
        start = day_of(now) - timedelta(days=length - 1)
        inside = [d for d in days if d["day"] >= start]
        windows[f"{length}d"] = Window(
            days=length,
            observed_seconds=sum(d["observed_seconds"] for d in inside),
            up_seconds=sum(d["up_seconds"] for d in inside),
            leases={o.value: sum(d[OUTCOME_COLUMNS[o]] for d in inside) for o in LeaseOutcome},
        ).as_dict()
    per_device: dict[str, int] = defaultdict(int)
    for d in days:
        for device_id, count in (d["device_faults"] or {}).items():
            per_device[device_id] += int(count)
    return {
        "reliability": node.reliability,
        "rated": node.reliability is not None,
        "min_sample": conf.get("RELIABILITY_MIN_SAMPLE"),
        "window_days": conf.get("RELIABILITY_WINDOW_DAYS"),
        "windows": windows,
        "device_faults": dict(sorted(per_device.items())),
        "reverifications": {
            "passed": sum(1 for r in runs if r["state"] == ReverificationState.PASSED),
            "failed": sum(1 for r in runs if r["state"] == ReverificationState.FAILED),
            "runs": runs[:REVERIFICATIONS_SHOWN],
        },
    }


def metric_rows() -> list[list]:
    """``[[pool pk, unrated, n<=0.5, n<=0.9, n<=0.95, n<=0.99, n<=0.999, n<=1.0]]`` over non-retired
    nodes: one GROUP BY, run by the fleet-state task (fleet.fleet_state) so that a scrape does not
    scan the fleet. Cumulative, like a Prometheus histogram's ``le`` buckets."""
    buckets = {f"le{i}": Count("id", filter=Q(reliability__lte=bound)) for i, bound in enumerate(BUCKETS)}
    rows = (
        Node.objects.exclude(lifecycle=Lifecycle.RETIRED)
        .values_list("pool")
        .annotate(unrated=Count("id", filter=Q(reliability__isnull=True)), **buckets)
        .order_by()
    )
    return [list(row) for row in rows]


def metric_families(pools: dict, figures: dict):
    """The gauges of :func:`metric_rows`' stored figures (``pools``: ``{pk: name}``). Labels are the
    pool and the bucket bound: bounded, never a node id (docs/observability.md)."""
    by_bucket = GaugeMetricFamily(
        "nodepool_nodes_by_reliability",
        "Rated nodes whose reliability score (fleet.reliability, 30 days) is at most le, by pool (cumulative).",
        labels=["pool", "le"],
    )
    unrated = GaugeMetricFamily(
        "nodepool_nodes_reliability_unrated",
        "Nodes without a reliability score yet (fewer than RELIABILITY_MIN_SAMPLE counted leases), by pool.",
        labels=["pool"],
    )
    for pool_pk, count_unrated, *cumulative in figures.get("reliability") or []:
        name = pools.get(pool_pk)
        if name is None:
            continue
        unrated.add_metric([name], float(count_unrated))
        for bound, count in zip(BUCKETS, cumulative, strict=True):
            by_bucket.add_metric([name, str(bound)], float(count))
    return [by_bucket, unrated]
