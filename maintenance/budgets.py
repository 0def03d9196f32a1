"""Disruption-budget accounting, after Kubernetes' PodDisruptionBudget.

For a workload group with a budget:

- **healthy**: live leases of the group that no drain is evicting (no checkpoint request pending);
- **disrupted**: live leases a drain asked to checkpoint, plus leases a drain ended whose workload does
  not yet hold a newer live lease (a replacement has a larger fencing token), counted for at most
  ``replacement_grace`` seconds after the eviction;
- **allowed disruptions**: ``max_unavailable - disrupted``, or ``healthy - min_available``
  (Kubernetes' ``disruptionsAllowed = currentHealthy - desiredHealthy`` with
  ``expected = healthy + disrupted``), never below 0.

Kubernetes knows a group's desired size from its controller; we do not, so ``expected`` is what
we can see. Disruptions that no drain caused (a node lost) are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta

from django.db import transaction
from django.db.models import Exists, OuterRef

from leases.choices import LIVE_LEASE_STATES
from leases.models import Lease
from nodepool.api.problems import NotFound
from nodepool.api.versioning import check_version

from .errors import BUDGET_NOT_FOUND
from .models import DisruptionBudget, Eviction


@dataclass
class BudgetStatus:
    group: str
    max_unavailable: int | None
    min_available: int | None
    healthy: int
    disrupted: int
    allowed_disruptions: int

    def as_dict(self) -> dict:
        return asdict(self)


def budget_status(budget: DisruptionBudget, *, now) -> BudgetStatus:
    """The current healthy/disrupted counts and allowed disruptions of ``budget``'s group."""
    live = Lease.objects.filter(group=budget.group, state__in=LIVE_LEASE_STATES)
    being_evicted = Exists(Eviction.objects.filter(lease=OuterRef("pk"), withdrawn_at__isnull=True))
    live = live.annotate(being_evicted=being_evicted)
    healthy = live.filter(being_evicted=False).count()
    checkpointing = set(live.filter(being_evicted=True).values_list("workload_id", flat=True))
    replaced = Lease.objects.filter(
        workload_id=OuterRef("workload_id"),
        state__in=LIVE_LEASE_STATES,
        fencing_token__gt=OuterRef("fencing_token"),
    )
    ended = (
        Eviction.objects.filter(
            group=budget.group,
            withdrawn_at__isnull=True,
            created_at__gte=now - timedelta(seconds=budget.replacement_grace),
        )
        .exclude(lease__state__in=LIVE_LEASE_STATES)
        .annotate(replaced=Exists(replaced))
        .filter(replaced=False)
        .values_list("workload_id", flat=True)
    )
    # A workload evicted twice counts once; a replacement that is itself being evicted counts once too.
    disrupted = len(checkpointing | set(ended))
    if budget.max_unavailable is not None:
        allowed = budget.max_unavailable - disrupted
    else:
        allowed = healthy - (budget.min_available or 0)
    return BudgetStatus(
        group=budget.group,
        max_unavailable=budget.max_unavailable,
        min_available=budget.min_available,
        healthy=healthy,
        disrupted=disrupted,
        allowed_disruptions=max(0, allowed),
    )


def budgets_for_groups(groups, *, lock: bool) -> dict[str, DisruptionBudget]:
    """The budgets of ``groups`` by group; with ``lock``, rows locked in group order.

    Locking the budget rows serialises drains of different nodes that evict from the same group,
    so two of them cannot both spend the last allowed disruption (the PDB's optimistic
    concurrency in Kubernetes' eviction API does the same job). The fixed order avoids deadlocks.
    """
    groups = sorted({g for g in groups if g})
    if not groups:
        return {}
    qs = DisruptionBudget.objects.filter(group__in=groups).order_by("group")
    if lock:
        qs = qs.select_for_update()
    return {b.group: b for b in qs}


def statuses_for_groups(groups, *, now) -> list[dict]:
    """:class:`BudgetStatus` dicts of the budgets of ``groups`` (groups without a budget are skipped)."""
    budgets = budgets_for_groups(groups, lock=False)
    return [budget_status(budgets[group], now=now).as_dict() for group in sorted(budgets)]


def ration(candidates: list[Lease], *, now, lock: bool) -> tuple[list[Lease], dict[str, list[Lease]], list[dict]]:
    """Split ``candidates`` into leases a drain may disrupt now and leases a budget holds back.

    Lowest priority and oldest first within a group. Returns ``(allowed, held_by_group, statuses)``
    where ``statuses`` are the :class:`BudgetStatus` dicts of the groups involved.
    """
    budgets = budgets_for_groups((lease.group for lease in candidates), lock=lock)
    statuses = {group: budget_status(budget, now=now) for group, budget in budgets.items()}
    remaining = {group: status.allowed_disruptions for group, status in statuses.items()}
    allowed: list[Lease] = []
    held: dict[str, list[Lease]] = {}
    for lease in sorted(candidates, key=lambda item: (item.priority, item.granted_at, str(item.pk))):
        if lease.group not in remaining:
            allowed.append(lease)
        elif remaining[lease.group] > 0:
            remaining[lease.group] -= 1
            allowed.append(lease)
        else:
            held.setdefault(lease.group, []).append(lease)
    return allowed, held, [statuses[group].as_dict() for group in sorted(statuses)]


def create_budget(*, data: dict, actor) -> DisruptionBudget:
    """Create a budget from validated ``data`` (group, limits, replacement_grace, description)."""
    user = actor.user if actor.user is not None and actor.user.is_authenticated else None
    return DisruptionBudget.objects.create(created_by=user, **data)


def update_budget(*, budget_id, expected_version: int, data: dict) -> DisruptionBudget:
    """Change a budget under its row lock. Raises NotFound (404), PreconditionFailed (412)."""
    with transaction.atomic():
        budget = _lock_budget(budget_id)
        check_version(budget.version, expected_version)
        for name, value in data.items():
            setattr(budget, name, value)
        budget.version += 1
        budget.save()
    return budget


def delete_budget(*, budget_id, expected_version: int) -> None:
    """Delete a budget; drains it held back proceed at their next evaluation. Raises as update."""
    with transaction.atomic():
        budget = _lock_budget(budget_id)
        check_version(budget.version, expected_version)
        budget.delete()


def _lock_budget(budget_id) -> DisruptionBudget:
    try:
        return DisruptionBudget.objects.select_for_update().get(pk=budget_id)
    except (DisruptionBudget.DoesNotExist, ValueError) as exc:
        raise NotFound(f"No disruption budget {budget_id}.", BUDGET_NOT_FOUND) from exc


def overridden_budgets(leases: list[Lease], *, now) -> list[dict]:
    """The workload disruption budgets that revoking all of ``leases`` now overrides (a forced
    drain at its deadline says which): ``[{"group", "allowed", "evicted"}]``, by group."""
    groups: dict[str, int] = {}
    for lease in leases:
        if lease.group:
            groups[lease.group] = groups.get(lease.group, 0) + 1
    return [
        {"group": status["group"], "allowed": status["allowed_disruptions"], "evicted": groups[status["group"]]}
        for status in statuses_for_groups(groups, now=now)
        if status["allowed_disruptions"] < groups[status["group"]]
    ]


def record_evictions(drain, leases: list[Lease], kind: str, now) -> None:
    """One :class:`Eviction` per lease a drain disrupted (``kind``: an :class:`EvictionKind`):
    the rows the budgets count."""
    Eviction.objects.bulk_create(
        Eviction(
            drain=drain,
            lease=lease,
            workload_id=lease.workload_id,
            group=lease.group,
            fencing_token=lease.fencing_token,
            kind=kind,
            created_at=now,
        )
        for lease in leases
    )
