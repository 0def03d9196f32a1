"""Metrics of pool operations, read from their durable rows (so every process exports the same).

Names follow the ``nodepool_*`` conventions (Prometheus naming guide: base units, ``_total`` for
counters, pool names as labels, never ids). ``OperationsConfig.ready()`` registers
:class:`OperationsCollector` with ``/metrics`` (nodepool.metrics.register_collector); :func:`samples`
gives the same figures to anything else (the demo).

- ``nodepool_upgrade_nodes_total{pool,outcome}`` — upgrade node steps by outcome (done, failed);
  the upgrade success rate is ``done / (done + failed)``, also exported as
  ``nodepool_upgrade_success_ratio{pool}``.
- ``nodepool_upgrades{pool,state}`` — upgrades by state.
- ``nodepool_scale_up_seconds_{sum,count}{pool}`` — request pending → node ready, per machine.
- ``nodepool_scale_attempts_failed_total{pool}`` — provider calls that failed after retries, plus
  machines the provider accepted that failed later (not ready within ``boot_timeout``, refused at
  admission).
- ``nodepool_preemptions_total{pool}`` — preemption notices received.
- ``nodepool_pool_allowed_disruptions{pool,reason}`` — nodes automation may still disrupt now
  for each budgeted reason (upgrade, drift, expiry, repair, scale_down, consolidation) under the
  pool's active disruption budgets; 0 in a blackout window. A pool with no budget for a reason
  exports its members not disrupting.
- ``nodepool_pool_disruptions_blocked{pool,reason}`` — nodes automation wants to disrupt but may
  not (``GET /pools/{name}/disruptions`` names each blocker).
- ``nodepool_pool_drifted_nodes{pool}`` — members whose shape or versions differ from the pool's
  (:mod:`operations.drift`; ``Drifted=True``).
- ``nodepool_pool_expired_nodes{pool}`` — members past their expiry time and not replaced yet;
  ``nodepool_pool_oldest_expired_seconds{pool}`` — how long the longest-waiting of them has been
  expired (0 when none), what the alert on stuck expiry reads.
- ``nodepool_node_replacements{pool,reason,state}`` — drift/expiry replacements by state
  (pending, launching, draining, replaced, cancelled, failed).
- ``nodepool_pool_repair_breaker_open{pool}`` — 1 while the repair safety breaker holds every
  automated repair of a pool with repair rules (more than ``repair_max_unhealthy`` of it unhealthy),
  else 0 (operations.repair; alert ``NodepoolRepairBreakerOpen``).
- ``nodepool_repairs{pool,state}`` — automated repairs by state (pending, rebooting, verifying,
  replacing, succeeded, escalated, failed).
"""

from __future__ import annotations

from collections import defaultdict

from django.db.models import Count
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fleet.clock import detected_gaps

from . import disruption, expiry
from .choices import BUDGETED_REASONS, MachineState, ProviderKind, ScaleOutcome, UpgradeNodeState
from .drift import FOLLOWED
from .models import (
    DisruptionBlock,
    NodeReplacement,
    NodeShape,
    PoolOperations,
    Preemption,
    ProviderMachine,
    Repair,
    ScaleDecision,
    Upgrade,
    UpgradeNode,
)


def samples() -> dict:
    """``{metric name: {label tuple: value}}`` of every metric this module exports."""
    nodes = defaultdict(float)
    for pool, state, n in (
        UpgradeNode.objects.filter(state__in=[UpgradeNodeState.DONE, UpgradeNodeState.FAILED])
        .values_list("upgrade__pool__name", "state")
        .annotate(n=Count("pk"))
    ):
        nodes[(pool, state)] += n
    ratio = {}
    for pool in {pool for pool, _ in nodes}:
        done, failed = nodes.get((pool, UpgradeNodeState.DONE), 0), nodes.get((pool, UpgradeNodeState.FAILED), 0)
        ratio[(pool,)] = done / (done + failed) if done + failed else 1.0
    upgrades = {(p, s): n for p, s, n in Upgrade.objects.values_list("pool__name", "state").annotate(n=Count("pk"))}
    scale_sum, scale_count = defaultdict(float), defaultdict(float)
    for machine in ProviderMachine.objects.filter(ready_at__isnull=False).select_related("pool"):
        scale_sum[(machine.pool.name,)] += machine.scale_up_seconds or 0.0
        scale_count[(machine.pool.name,)] += 1
    failed = defaultdict(float)
    for p, n in (
        ScaleDecision.objects.filter(outcome=ScaleOutcome.FAILED).values_list("pool__name").annotate(n=Count("pk"))
    ):
        failed[(p,)] += n
    # A machine the provider accepted that never became ready (boot_timeout, or refused at
    # admission) is a failed scale attempt too, one per machine.
    for p, n in (
        ProviderMachine.objects.filter(state=MachineState.FAILED, decision__outcome=ScaleOutcome.SUCCEEDED)
        .values_list("pool__name")
        .annotate(n=Count("pk"))
    ):
        failed[(p,)] += n
    preemptions = {(p,): n for p, n in Preemption.objects.values_list("pool__name").annotate(n=Count("pk"))}
    allowed, blocked = {}, {}
    now = timezone.now()
    for ops in PoolOperations.objects.select_related("pool"):
        counts = (disruption.members(ops.pool), disruption.disrupting(ops.pool))
        for reason in BUDGETED_REASONS:
            verdict = disruption.pool_allowance(ops.pool, ops.disruption_budgets or [], reason, now=now, counts=counts)
            value = verdict.allowed_disruptions
            allowed[(ops.pool.name, reason)] = value if value is not None else max(0, counts[0] - counts[1])
    for pool, reason, n in DisruptionBlock.objects.values_list("pool__name", "reason").annotate(n=Count("pk")):
        blocked[(pool, reason)] = n
    consolidations = defaultdict(float)
    for pool, action, n in (
        ScaleDecision.objects.filter(data__consolidation__in=["delete", "replace"])
        .exclude(outcome=ScaleOutcome.BLOCKED)
        .values_list("pool__name", "data__consolidation")
        .annotate(n=Count("pk"))
    ):
        consolidations[(pool, action)] += n
    backoff, failures = {}, {}
    for name, until, n in PoolOperations.objects.exclude(provider=ProviderKind.NONE).values_list(
        "pool__name", "backoff_until", "consecutive_failures"
    ):
        backoff[(name,)] = max(0.0, (until - now).total_seconds()) if until else 0.0
        failures[(name,)] = float(n)
    drifted, expired, oldest = _drift_and_expiry(now)
    replacements = {
        (p, r, st): n
        for p, r, st, n in NodeReplacement.objects.values_list("pool__name", "reason", "state").annotate(n=Count("pk"))
    }
    breaker = {
        (pool,): float(is_open)
        for pool, rules, is_open in PoolOperations.objects.values_list(
            "pool__name", "repair_rules", "repair_breaker_open"
        )
        if rules or is_open
    }
    repairs = {(p, s): n for p, s, n in Repair.objects.values_list("pool__name", "state").annotate(n=Count("pk"))}
    return {
        "nodepool_upgrade_nodes_total": dict(nodes),
        "nodepool_upgrade_success_ratio": ratio,
        "nodepool_upgrades": upgrades,
        "nodepool_scale_up_seconds_sum": dict(scale_sum),
        "nodepool_scale_up_seconds_count": dict(scale_count),
        "nodepool_scale_attempts_failed_total": dict(failed),
        "nodepool_preemptions_total": preemptions,
        "nodepool_pool_allowed_disruptions": allowed,
        "nodepool_pool_disruptions_blocked": blocked,
        "nodepool_consolidations_total": dict(consolidations),
        "nodepool_pool_scale_up_backoff_seconds": backoff,
        "nodepool_pool_scale_up_consecutive_failures": failures,
        "nodepool_pool_drifted_nodes": drifted,
        "nodepool_pool_expired_nodes": expired,
        "nodepool_pool_oldest_expired_seconds": oldest,
        "nodepool_node_replacements": replacements,
        "nodepool_pool_repair_breaker_open": breaker,
        "nodepool_repairs": repairs,
    }


def _drift_and_expiry(now) -> tuple[dict, dict, dict]:
    """``(drifted, expired, oldest expired seconds)``, each ``{(pool,): value}``: drifted for every
    pool with nodes the drift sweep follows; expired (members past their expiry time: a replaced
    node was re-admitted, so its time started over, or retired) for every pool with ``expire_after``."""
    shapes = NodeShape.objects.filter(node__lifecycle__in=FOLLOWED)
    drifted = {(p,): 0.0 for p in shapes.values_list("pool__name", flat=True).distinct()}
    for p, n in shapes.filter(drifted=True).values_list("pool__name").annotate(n=Count("pk")):
        drifted[(p,)] = float(n)
    expired, oldest = {}, {}
    gaps = None
    for ops in PoolOperations.objects.filter(expire_after__isnull=False).select_related("pool"):
        gaps = detected_gaps() if gaps is None else gaps
        late = [
            (now - due).total_seconds()
            for node_id, admitted_at in shapes.filter(pool=ops.pool).values_list("node_id", "admitted_at")
            if (due := expiry.expires_at(node_id=node_id, admitted_at=admitted_at, expire_after=ops.expire_after,
                                         gaps=gaps)) <= now
        ]  # fmt: skip
        expired[(ops.pool.name,)] = float(len(late))
        oldest[(ops.pool.name,)] = max(late, default=0.0)
    return drifted, expired, oldest


class OperationsCollector:
    """A prometheus_client collector (``REGISTRY.register(OperationsCollector())``)."""

    def collect(self):
        data = samples()
        family = CounterMetricFamily(
            "nodepool_upgrade_nodes", "Upgrade node steps by outcome.", labels=["pool", "outcome"]
        )
        for labels, value in data["nodepool_upgrade_nodes_total"].items():
            family.add_metric(list(labels), value)
        yield family
        gauge = GaugeMetricFamily(
            "nodepool_upgrade_success_ratio", "Upgraded nodes / nodes attempted.", labels=["pool"]
        )
        for labels, value in data["nodepool_upgrade_success_ratio"].items():
            gauge.add_metric(list(labels), value)
        yield gauge
        gauge = GaugeMetricFamily("nodepool_upgrades", "Upgrades by state.", labels=["pool", "state"])
        for labels, value in data["nodepool_upgrades"].items():
            gauge.add_metric(list(labels), value)
        yield gauge
        for name, help_text in (
            ("nodepool_scale_up_seconds_sum", "Seconds from pending demand to new node ready, summed."),
            ("nodepool_scale_up_seconds_count", "Machines that became ready."),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["pool"])
            for labels, value in data[name].items():
                gauge.add_metric(list(labels), value)
            yield gauge
        for name, help_text in (
            ("nodepool_scale_attempts_failed", "Scale requests the provider failed after retries."),
            ("nodepool_preemptions", "Preemption notices received."),
        ):
            family = CounterMetricFamily(name, help_text, labels=["pool"])
            for labels, value in data[f"{name}_total"].items():
                family.add_metric(list(labels), value)
            yield family
        for name, help_text in (
            ("nodepool_pool_allowed_disruptions", "Nodes automation may still disrupt now, per reason."),
            ("nodepool_pool_disruptions_blocked", "Nodes automation wants to disrupt but may not, per reason."),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["pool", "reason"])
            for labels, value in data[name].items():
                gauge.add_metric(list(labels), value)
            yield gauge
        family = CounterMetricFamily(
            "nodepool_consolidations", "Consolidation actions (delete, replace).", labels=["pool", "action"]
        )
        for labels, value in data["nodepool_consolidations_total"].items():
            family.add_metric(list(labels), value)
        yield family
        for name, help_text in (
            ("nodepool_pool_scale_up_backoff_seconds", "Seconds left of the pool's scale-up back-off (0: none)."),
            ("nodepool_pool_scale_up_consecutive_failures", "Consecutive failed launches (reset by a ready machine)."),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["pool"])
            for labels, value in data[name].items():
                gauge.add_metric(list(labels), value)
            yield gauge
        for name, help_text in (
            ("nodepool_pool_drifted_nodes", "Members whose shape or versions differ from their pool's (Drifted=True)."),
            ("nodepool_pool_expired_nodes", "Members past their expiry time, not replaced yet."),
            ("nodepool_pool_oldest_expired_seconds", "Seconds the longest-waiting expired member has been expired."),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["pool"])
            for labels, value in data[name].items():
                gauge.add_metric(list(labels), value)
            yield gauge
        gauge = GaugeMetricFamily(
            "nodepool_node_replacements", "Drift and expiry replacements by state.", labels=["pool", "reason", "state"]
        )
        for labels, value in data["nodepool_node_replacements"].items():
            gauge.add_metric(list(labels), value)
        yield gauge
        gauge = GaugeMetricFamily(
            "nodepool_pool_repair_breaker_open",
            "1 while the repair safety breaker holds every automated repair of the pool.",
            labels=["pool"],
        )
        for labels, value in data["nodepool_pool_repair_breaker_open"].items():
            gauge.add_metric(list(labels), value)
        yield gauge
        gauge = GaugeMetricFamily("nodepool_repairs", "Automated repairs by state.", labels=["pool", "state"])
        for labels, value in data["nodepool_repairs"].items():
            gauge.add_metric(list(labels), value)
        yield gauge
