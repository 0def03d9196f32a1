"""What the lease services count as it happens (per-process metrics of :mod:`nodepool.metrics`).

Counted after commit (``transaction.on_commit``) so that a rolled-back grant counts nothing.
"""

from __future__ import annotations

from django.db import transaction

from nodepool import metrics

from .choices import LeaseState

# Why a lease ended, as a bounded label, from the reason its caller wrote (first match wins).
# The callers' reasons are stable strings of this code base (leases.reconcile, leases.sweeps,
# maintenance.drains, maintenance.services, fleet.liveness); an unknown reason counts as "other".
CAUSES = (
    ("drain deadline", "drain_deadline"),
    ("drain forced", "drain_deadline"),
    ("drain", "drain"),
    ("workload checkpointed for drain", "drain"),
    ("node quarantined", "quarantine"),
    ("node retired", "retired"),
    ("evicted: the node has a noexecute", "noexecute"),
    ("node lost", "node_lost"),
    ("not reported by the node", "not_reported"),
    ("the node restarted", "node_restarted"),
    ("revoked in the admin", "operator"),
)


def ending_cause(to_state: str, reason: str) -> str:
    """The bounded cause label of a lease ending: ``ttl`` for expiry, else from :data:`CAUSES`."""
    if to_state == LeaseState.EXPIRED:
        return "ttl"
    text = (reason or "").lower()
    for prefix, cause in CAUSES:
        if text.startswith(prefix):
            return cause
    return "other"


def lease_ended(*, pool: str, to_state: str, reason: str) -> None:
    """Count a lease that was lost, revoked or expired (releases by the client are not losses)."""
    if to_state in (LeaseState.LOST, LeaseState.REVOKED, LeaseState.EXPIRED):
        cause = ending_cause(to_state, reason)
        transaction.on_commit(lambda: metrics.LEASE_ENDINGS.labels(pool, to_state, cause).inc())


def lease_granted(*, pool: str, grant_seconds: float, pending_seconds: float) -> None:
    """Count a grant: its placement time and how long its request waited in all."""

    def count():
        metrics.LEASE_GRANTS.labels(pool).inc()
        metrics.LEASE_GRANT_SECONDS.labels(pool).observe(grant_seconds)
        metrics.LEASE_PENDING_SECONDS.labels(pool).observe(max(0.0, pending_seconds))

    transaction.on_commit(count)


def placement_failed(*, pool: str, reasons: dict[str, int]) -> None:
    """Count one unschedulable answer under each reason code its explanation gives."""
    for reason in reasons or {"no_nodes": 1}:
        metrics.PLACEMENT_FAILURES.labels(pool, reason).inc()
