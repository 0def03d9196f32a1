"""Pricing: a pool's price per resource-hour, versioned by effective time (the one definition;
the observability issue's cost figures read :func:`price_at`).

A lease's billable intervals are priced piecewise: each part of an interval is charged at the
price in force at that moment, so a price change applies from its effective time, not from the
next lease. Resource units (canonical amounts in ``Lease.resources``): ``cpu`` millicores are
priced per core (÷1000), ``memory`` and ``ephemeral-storage`` bytes per GiB (÷2**30), every other
resource per unit. A line's amount is rounded once, to the currency's cents (ROUND_HALF_UP).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

from django.db import IntegrityError, transaction
from django.utils.dateparse import parse_datetime

from nodepool.api.problems import Conflict

from .errors import CURRENCY_MISMATCH, PRICE_VERSION_EXISTS
from .models import PoolPrice

UNITS = {"cpu": Decimal(1000), "memory": Decimal(2**30), "ephemeral-storage": Decimal(2**30)}
CENT = Decimal("0.01")
QUANTITY = Decimal("0.000001")
HOUR = Decimal(3600)


def unit_of(resource: str) -> Decimal:
    """Canonical amount in one priced unit of ``resource``."""
    return UNITS.get(resource, Decimal(1))


def price_at(pool_id, resource: str, at: datetime) -> PoolPrice | None:
    """The price of ``resource`` in the pool in force at ``at`` (None when there is none yet)."""
    return (
        PoolPrice.objects.filter(pool_id=pool_id, resource=resource, effective_from__lte=at)
        .order_by("-effective_from")
        .first()
    )


def set_price(
    *, pool, resource: str, unit_price: Decimal, currency: str, effective_from: datetime, user=None, note: str = ""
) -> PoolPrice:
    """Publish a new price version. Every price of one pool shares one currency.

    Raises: Conflict 409 ``currency_mismatch`` (the pool is priced in another currency) or
    ``price_version_exists`` (a price for this resource at exactly this time exists).
    """
    other = PoolPrice.objects.filter(pool=pool).exclude(currency=currency).values_list("currency", flat=True).first()
    if other:
        raise Conflict(
            f"Pool {pool.name} is priced in {other}; every price of a pool shares one currency.", CURRENCY_MISMATCH
        )
    try:
        with transaction.atomic():
            return PoolPrice.objects.create(
                pool=pool,
                resource=resource,
                unit_price=unit_price,
                currency=currency,
                effective_from=effective_from,
                created_by=user,
                note=note,
            )
    except IntegrityError as exc:
        raise Conflict(
            "A price for this resource takes effect at exactly this time already.", PRICE_VERSION_EXISTS
        ) from exc


@dataclass
class Priced:
    """``quantities``: ``{resource: resource-hours}``; ``amount`` in ``currency`` (cents);
    ``unpriced``: resources (or times) without a price in force, charged nothing."""

    quantities: dict[str, Decimal]
    amount: Decimal
    currency: str
    unpriced: list[str]


def price_intervals(*, pool_id, resources: dict[str, int], intervals: list[tuple[datetime, datetime]]) -> Priced:
    """Charge ``resources`` held over ``intervals`` at the pool's prices in force (piecewise)."""
    prices: dict[str, list[PoolPrice]] = {}
    for price in PoolPrice.objects.filter(pool_id=pool_id, resource__in=list(resources)).order_by("effective_from"):
        prices.setdefault(price.resource, []).append(price)
    currencies = {p.currency for versions in prices.values() for p in versions}
    amount = Decimal(0)
    quantities: dict[str, Decimal] = {}
    unpriced: set[str] = set()
    for resource, canonical in sorted(resources.items()):
        units = Decimal(int(canonical)) / unit_of(resource)
        versions = prices.get(resource, [])
        hours_total = Decimal(0)
        for start, end in intervals:
            hours_total += Decimal(str((end - start).total_seconds())) / HOUR
            for index, price in enumerate(versions):
                until = versions[index + 1].effective_from if index + 1 < len(versions) else None
                lo = max(start, price.effective_from)
                hi = min(end, until) if until else end
                if hi > lo:
                    hours = Decimal(str((hi - lo).total_seconds())) / HOUR
                    amount += units * hours * price.unit_price
            if not versions or start < versions[0].effective_from:
                unpriced.add(resource)
        quantities[resource] = (units * hours_total).quantize(QUANTITY, rounding=ROUND_HALF_UP)
    return Priced(
        quantities=quantities,
        amount=amount.quantize(CENT, rounding=ROUND_HALF_UP),
        currency=currencies.pop() if len(currencies) == 1 else "",
        unpriced=sorted(unpriced),
    )


def intervals_of(record) -> list[tuple[datetime, datetime]]:
    """A usage record's billable intervals as datetimes."""
    return [(parse_datetime(a), parse_datetime(b)) for a, b in record.billable_intervals or []]
