"""Hook receivers connected in MarketplaceConfig.ready()."""

from __future__ import annotations

from . import reconciliation


def open_usage_record(sender, *, lease, now, **kwargs) -> None:
    """``leases.signals.lease_ended``: open the lease's usage record in the same transaction."""
    reconciliation.open_usage_record(lease=lease, now=now)
