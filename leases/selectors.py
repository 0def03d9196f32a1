"""Read-only questions about leases that several domain modules ask (no writes here).

Below leases.fencing and leases.secrets, which both ask :func:`fence_status` (the fencing
validation's core): the per-lease secret check (leases.secrets) and the ``fencing/validate``
endpoint (leases.fencing) no longer import each other (issue 28, step 4).
"""

from __future__ import annotations

from nodepool.api.permissions import is_operator
from nodepool.api.problems import NotFound

from .choices import LIVE_LEASE_STATES
from .models import FencingSequence, Lease


def visible(queryset, user):
    """Operators see every lease; clients only their own (others' answer 404, never 403: no leak)."""
    return queryset if is_operator(user) else queryset.filter(client=user)


def fence_status(workload_id: str, token: int, *, may_see=None) -> dict:
    """Is ``(workload_id, token)`` the workload's current, live lease?

    Args:
        may_see: ``callable(lease) -> bool``, who may learn about the workload's latest lease;
            ``None`` lets everyone see.

    Returns ``{"valid": bool, "current_token": int | None, "last_issued_token": int | None,
    "lease_id": str | None}``.

    Raises:
        NotFound: 404 when the workload has no lease, or the caller may not see its latest one
            (the same answer, so the endpoint does not reveal which workloads exist).
    """
    latest = (
        Lease.objects.filter(workload_id=workload_id).select_related("node").order_by("-fencing_token", "-pk").first()
    )
    if latest is None or (may_see is not None and not may_see(latest)):
        raise NotFound("No lease of this workload is visible to you.")
    current = FencingSequence.objects.filter(pk=workload_id).values_list("last_token", flat=True).first()
    live = latest if latest.state in LIVE_LEASE_STATES else None
    if live is None:
        live = Lease.objects.filter(workload_id=workload_id, state__in=LIVE_LEASE_STATES).first()
        if live is not None and may_see is not None and not may_see(live):
            # Workload ids are one namespace across clients: a live lease the caller may not see is
            # never named (the same 404 as an unseen latest lease).
            raise NotFound("No lease of this workload is visible to you.")
    valid = live is not None and live.fencing_token == token and token == current
    return {
        "valid": valid,
        "current_token": live.fencing_token if live else None,
        "last_issued_token": current,
        "lease_id": str(live.pk) if live else None,
    }
