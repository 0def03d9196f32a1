"""Pool disruption budgets and the one gate every automated disruption asks before it cordons.

A pool's ``PoolOperations.disruption_budgets`` is a list of budgets, after Karpenter's NodePool
``spec.disruption.budgets``::

    [{"nodes": "10%"},                                   # the default (every pool has it)
     {"nodes": "0", "reasons": ["upgrade", "drift"],     # a blackout window: no upgrade or drift
      "schedule": "0 9 * * 1-5", "duration": "8h",       # on weekdays 09:00-17:00
      "timezone": "Europe/Berlin"}]

- ``nodes``: a count (``"2"``, or the integer 2) or a percentage of the pool's members
  (``"10%"``, 0-100). A percentage is rounded **up**, with a minimum of 1 unless it is 0 %
  (Karpenter rounds up too; Kubernetes' maxUnavailable rounds down, which is why an upgrade's own
  ``max_unavailable_nodes`` keeps its old rule).
- ``reasons``: the automated disruptions it limits (:data:`~operations.choices.BUDGETED_REASONS`:
  upgrade, drift, expiry, repair, scale_down, consolidation); absent = all of them.
- ``schedule`` + ``duration`` (both or neither): the budget is active from each cron firing
  (5-field cron or ``@daily``-style macros, croniter) for ``duration`` (``"1h30m"``, ``"45m"``,
  ``"90s"`` or seconds as an integer), in ``timezone`` (IANA name, default UTC). Without a
  schedule the budget is always active. ``nodes: 0`` with a schedule is a **blackout window**.

The **allowed disruptions** for a reason = the most restrictive limit of the active budgets that
name it (and, for an upgrade, its ``max_unavailable_nodes``) minus the pool's members that are
**disrupting** now: not ready, not alive, not reporting ready, unhealthy, or carrying a hold of an
automated owner (:data:`operations.outofservice.SYSTEM_OWNERS`) — the node asked about aside (taking
out a node already unavailable makes nothing worse). An operator's own cordon of a ready node does
not count (Karpenter counts nodes being deleted or NotReady, not cordons).

:func:`request_disruption` is the gate. Every automated disruption (upgrade, scale-down, drift,
expiry, repair, consolidation) calls it — through :func:`disrupt` — in the
transaction that cordons the node; it locks the pool's ``PoolOperations`` row, so two automations
never both spend the last allowed disruption. Operators' own drains do not ask it (workload
budgets still apply to them, in the drain). Spot preemption is forced and does not ask.

When the answer is no, the gate says why: a :class:`~operations.models.DisruptionBlock` row on the
node (shown on the node and the pool) and, when the blocker changed, a ``disruption_blocked`` event.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import croniter
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from fleet.choices import Lifecycle, Liveness
from fleet.events import Actor, record_event
from fleet.models import Node, NodeHold, Pool
from fleet.selectors import SCHEDULABLE_HEALTH
from leases.choices import LIVE_LEASE_STATES
from leases.models import Lease
from maintenance.budgets import budget_status, budgets_for_groups
from maintenance.models import Drain

from . import event_types, outofservice
from .budgets import parse_duration
from .choices import BUDGETED_REASONS, DisruptionReason
from .models import DisruptionBlock, PoolOperations

DEFAULT_BUDGETS = [{"nodes": "10%"}]
# Blockers that hold every node of the pool alike: once one says no, the rest of a pass waits too.
POOL_LEVEL = ("pool_budget", "window", "max_unavailable_nodes")


# --- reading budgets ------------------------------------------------------------------------------
def budget_limit(nodes: str, members: int) -> int:
    """The node count ``nodes`` allows for a pool of ``members`` (percentages rounded up, at least
    1 unless 0 %: Karpenter's rule)."""
    if nodes.endswith("%"):
        percent = int(nodes[:-1])
        return 0 if percent == 0 else max(1, math.ceil(members * percent / 100))
    return int(nodes)


def window(budget: dict, now: datetime) -> tuple[bool, datetime | None, datetime | None]:
    """``(active, since, until)`` of ``budget`` at ``now``: always active without a schedule;
    with one, active from its latest firing for its duration (``since``/``until`` of that window,
    or of the next one when inactive)."""
    schedule = budget.get("schedule")
    if not schedule:
        return True, None, None
    tz = ZoneInfo(budget.get("timezone") or "UTC")
    local = now.astimezone(tz)
    seconds = parse_duration(budget.get("duration"))
    # A firing exactly at ``now`` starts the window: croniter's get_prev is strictly before its base.
    last = croniter(schedule, local + timedelta(seconds=1)).get_prev(datetime)
    if last <= local < last + timedelta(seconds=seconds):
        return True, last, last + timedelta(seconds=seconds)
    start = croniter(schedule, local).get_next(datetime)
    return False, start, start + timedelta(seconds=seconds)


def applies(budget: dict, reason: str) -> bool:
    return reason in (budget.get("reasons") or BUDGETED_REASONS)


def disrupting_q() -> Q:
    """Members that count against the budgets: not ready, not alive, not reporting ready,
    unhealthy, or held by an automated owner (an operator's own cordon is not counted)."""
    held = Q(pk__in=_held_ids(outofservice.SYSTEM_OWNERS))
    serving = Q(lifecycle=Lifecycle.READY, liveness=Liveness.ALIVE, ready=True, health__in=SCHEDULABLE_HEALTH)
    return ~serving | held


def _held_ids(owners):
    return NodeHold.objects.filter(owner__in=owners, removed_at__isnull=True).values("node_id")


def members(pool) -> int:
    return Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED).count()


def disrupting(pool, *, exclude=None) -> int:
    """Members disrupting now (:func:`disrupting_q`), leaving out the node ``exclude``."""
    nodes = Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED).filter(disrupting_q())
    return (nodes.exclude(pk=exclude) if exclude is not None else nodes).count()


@dataclass
class Verdict:
    """The gate's answer. ``blocker`` (when not allowed): ``{"kind": "pool_budget" | "window" |
    "max_unavailable_nodes" | "workload_budget", "detail": str, ...}`` with the budget's index and
    shape, or the workload group and the lease."""

    allowed: bool
    reason: str
    allowed_disruptions: int | None = None
    blocker: dict = field(default_factory=dict)

    @property
    def pool_level(self) -> bool:
        return self.blocker.get("kind") in POOL_LEVEL

    def describe(self) -> str:
        return self.blocker.get("detail", "allowed")

    def as_dict(self) -> dict:
        return asdict(self)


def pool_allowance(
    pool, budgets: list[dict], reason: str, *, now, max_unavailable: int | None = None, counts=None
) -> Verdict:
    """How many more nodes ``reason`` may disrupt in ``pool`` now, and what limits it.

    ``counts``: ``(members, disrupting)`` when the caller has them. ``max_unavailable``: an
    upgrade's own limit in nodes (already including its ready surge nodes)."""
    n_members, n_disrupting = counts or (members(pool), disrupting(pool))
    tightest: tuple[int, dict] | None = None
    if reason != DisruptionReason.PREEMPTION:
        for index, budget in enumerate(budgets):
            if not applies(budget, reason):
                continue
            active, since, until = window(budget, now)
            if not active:
                continue
            limit = budget_limit(budget["nodes"], n_members)
            if tightest is None or limit < tightest[0]:
                is_window = bool(budget.get("schedule")) and limit == 0
                kind = "window" if is_window else "pool_budget"
                shown = {"index": index, **budget}
                if is_window:
                    detail = (
                        f"blackout window: pool budget #{index} (nodes {budget['nodes']}, {budget['schedule']} "
                        f"for {budget['duration']} {budget.get('timezone', 'UTC')}) until {until.isoformat()}"
                    )
                else:
                    detail = (
                        f"pool budget #{index} (nodes {budget['nodes']} = {limit} of {n_members}) allows "
                        f"{max(0, limit - n_disrupting)} more: {n_disrupting} node(s) disrupting"
                    )
                until_text = until.isoformat() if until else None
                tightest = (limit, {"kind": kind, "budget": shown, "until": until_text, "detail": detail})
    if max_unavailable is not None and (tightest is None or max_unavailable < tightest[0]):
        tightest = (
            max_unavailable,
            {
                "kind": "max_unavailable_nodes",
                "limit": max_unavailable,
                "detail": f"max_unavailable_nodes allows {max(0, max_unavailable - n_disrupting)} more: "
                f"{n_disrupting} of {max_unavailable} node(s) disrupting",
            },
        )
    if tightest is None:
        return Verdict(True, reason, None)
    allowed = max(0, tightest[0] - n_disrupting)
    return Verdict(allowed > 0, reason, allowed, {} if allowed > 0 else tightest[1])


def workload_blocker(node: Node, *, now) -> dict:
    """The first workload disruption budget that would refuse evicting every live lease of
    ``node`` now: ``{"kind": "workload_budget", "group", "lease_id", "allowed", "wanted", "detail"}``,
    or ``{}`` when all allow it."""
    groups: dict[str, list] = {}
    for lease_id, group in (
        Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).exclude(group="").values_list("pk", "group")
    ):
        groups.setdefault(group, []).append(lease_id)
    budgets = budgets_for_groups(groups, lock=False)
    for group in sorted(groups):
        if group not in budgets:
            continue
        allowed = budget_status(budgets[group], now=now).allowed_disruptions
        wanted = len(groups[group])
        if allowed < wanted:
            return {
                "kind": "workload_budget",
                "group": group,
                "lease_id": str(groups[group][0]),
                "allowed": allowed,
                "wanted": wanted,
                "detail": f"workload disruption budget of group {group!r} allows {allowed} eviction(s), "
                f"lease {groups[group][0]} and {wanted - 1} more on the node need {wanted}",
            }
    return {}


def lock_pool_operations(pool_id) -> PoolOperations:
    """The pool's settings row ``FOR UPDATE`` (that row alone: see :mod:`operations.autoscaler`)."""
    ops, _ = PoolOperations.objects.get_or_create(pool_id=pool_id)
    return PoolOperations.objects.select_for_update(of=("self",)).get(pk=ops.pk)


def request_disruption(
    *, node: Node, reason: str, owner: str, now=None, max_unavailable: int | None = None, record: bool = True
) -> Verdict:
    """May ``owner`` disrupt ``node`` now, for ``reason``? The one gate (see the module doc).

    Must run inside the transaction that then cordons the node (:func:`outofservice.disrupt`):
    it locks the pool's settings row, so the count it read stays true until that commit. A
    refusal is recorded (:func:`record_blocked`) unless ``record`` is False.
    """
    now = now or timezone.now()
    ops = lock_pool_operations(node.pool_id)
    # The node itself is not counted: taking out a node that is already unavailable (a lost node
    # being replaced, an unhealthy one being repaired) makes nothing worse.
    counts = (members(node.pool), disrupting(node.pool, exclude=node.pk))
    verdict = pool_allowance(
        node.pool, ops.disruption_budgets or [], reason, now=now, max_unavailable=max_unavailable, counts=counts
    )
    if verdict.allowed:
        blocker = workload_blocker(node, now=now)
        if blocker:
            verdict = Verdict(False, reason, verdict.allowed_disruptions, blocker)
    if not verdict.allowed and record:
        record_blocked(node=node, reason=reason, owner=owner, blocker=verdict.blocker, now=now)
    return verdict


def record_blocked(*, node: Node, reason: str, owner: str, blocker: dict, now) -> None:
    """Remember on the node why automation may not disrupt it; a ``disruption_blocked`` event when
    the blocker changed (a tick that is refused for the same reason again writes no event)."""
    detail = blocker.get("detail", "")[:2000]
    with transaction.atomic():
        # One row per node: the row is locked, or created in a savepoint; a concurrent refusal of
        # the same node (two bulk drains, a tick beside one) that created it first is then read
        # and locked instead of failing on the unique node.
        row = DisruptionBlock.objects.select_for_update().filter(node=node).first()
        if row is None:
            try:
                with transaction.atomic():
                    row = DisruptionBlock.objects.create(node=node, pool_id=node.pool_id, since=now, last_seen_at=now,
                                                         reason=reason, owner=owner, kind=blocker.get("kind", ""),
                                                         detail=detail, blocker=blocker)  # fmt: skip
                changed = True
            except IntegrityError:
                row = DisruptionBlock.objects.select_for_update().get(node=node)
                changed = None
        else:
            changed = None
        if changed is None:
            changed = row.reason != reason or row.kind != blocker.get("kind") or row.detail != detail
            if changed:
                row.since = now
            row.pool_id = node.pool_id
            row.reason, row.owner, row.kind = reason, owner, blocker.get("kind", "")
            row.detail, row.blocker, row.last_seen_at = detail, blocker, now
            row.save()
    if changed:
        record_event(
            node,
            event_types.DISRUPTION_BLOCKED,
            Actor.system(owner),
            pool=node.pool_id,
            subject_type="disruption",
            reason=f"{reason} blocked: {detail}",
            data={"reason": reason, "owner": owner, "blocker": blocker},
        )


def clear_blocked(node: Node) -> None:
    """The node was disrupted (or automation no longer wants it): it is no longer blocked."""
    DisruptionBlock.objects.filter(node=node).delete()


class DisruptionBlocked(Exception):
    """The gate said no (:func:`request_disruption`); ``verdict`` says why.

    The caller calls :meth:`record` once outside any savepoint the exception unwinds (a refusal
    recorded inside a rolled-back savepoint would vanish with it)."""

    def __init__(self, verdict: Verdict, *, node: Node, owner: str, now):
        super().__init__(verdict.describe())
        self.verdict, self.node, self.owner, self.now = verdict, node, owner, now

    def record(self) -> None:
        record_blocked(
            node=self.node, reason=self.verdict.reason, owner=self.owner, blocker=self.verdict.blocker, now=self.now
        )


def disrupt(
    *,
    node: Node,
    reason: str,
    owner: str,
    why: str,
    policy: str,
    deadline=None,
    timeout: int = 600,
    max_unavailable: int | None = None,
    now=None,
) -> Drain:
    """Ask the one gate whether ``owner`` may disrupt ``node`` for ``reason`` (a
    :class:`~operations.choices.DisruptionReason`), and if so cordon and drain it in the same
    transaction (:func:`operations.outofservice.take_out_of_service`). Every automated disruption
    comes through here.

    Raises: :class:`DisruptionBlocked` (nothing changed; call its ``record()`` to say why on
    the node), or the errors of :func:`operations.outofservice.take_out_of_service`.
    """
    now = now or timezone.now()
    with transaction.atomic():
        verdict = request_disruption(
            node=node, reason=reason, owner=owner, now=now, max_unavailable=max_unavailable, record=False
        )
        if not verdict.allowed:
            raise DisruptionBlocked(verdict, node=node, owner=owner, now=now)
        drain = outofservice.take_out_of_service(
            node=node, owner=owner, reason=why, policy=policy, deadline=deadline, timeout=timeout, now=now
        )
        clear_blocked(node)
        return drain


def pool_status(pool: Pool, *, now=None) -> dict:
    """What ``GET /pools/{name}/disruptions``, the admin and ``nodepoolctl describe pool`` show:
    ``{"pool", "members", "disrupting", "budgets": [{index, nodes, reasons, schedule, duration,
    timezone, "limit", "active", "window_start", "window_end"}], "allowed_disruptions": {reason: n},
    "blocked": [{node_id, node, reason, owner, kind, detail, since, last_seen_at}]}``."""
    now = now or timezone.now()
    ops, _ = PoolOperations.objects.get_or_create(pool=pool)
    budgets = ops.disruption_budgets or []
    counts = (members(pool), disrupting(pool))
    shown = []
    for index, budget in enumerate(budgets):
        active, since, until = window(budget, now)
        shown.append(
            {
                "index": index,
                **budget,
                "limit": budget_limit(budget["nodes"], counts[0]),
                "active": active,
                "window_start": since.isoformat() if since else None,
                "window_end": until.isoformat() if until else None,
            }
        )
    allowed = {}
    for reason in BUDGETED_REASONS:
        verdict = pool_allowance(pool, budgets, reason, now=now, counts=counts)
        allowed[reason] = verdict.allowed_disruptions
    blocked = [
        _block_dict(row) for row in DisruptionBlock.objects.filter(pool=pool).select_related("node").order_by("since")
    ]
    return {
        "pool": pool.name,
        "members": counts[0],
        "disrupting": counts[1],
        "budgets": shown,
        "allowed_disruptions": allowed,
        "blocked": blocked,
    }


def _block_dict(row: DisruptionBlock) -> dict:
    return {
        "node_id": str(row.node_id),
        "node": str(row.node),
        "reason": row.reason,
        "owner": row.owner,
        "kind": row.kind,
        "detail": row.detail,
        "blocker": row.blocker,
        "since": row.since.isoformat(),
        "last_seen_at": row.last_seen_at.isoformat(),
    }


def node_status(node: Node) -> dict | None:
    """The node's latest refusal by the gate (shape of ``pool_status``'s ``blocked`` items), or None."""
    row = DisruptionBlock.objects.filter(node=node).select_related("node").first()
    return _block_dict(row) if row else None
