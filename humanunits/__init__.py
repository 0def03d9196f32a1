"""Amounts and times for people: the one formatting module of nodepool (issue 33, item 4).

Pure Python, standard library only, so that every part of nodepool uses it: the server apps
(error details, condition messages, admin, overview), the benchmark, the demo, and ``nodepoolctl``,
which talks to the server over HTTP only and must not import the server's ``nodepool`` package
(importing that package loads Celery and Django). It lives beside them as its own tiny package
(pyproject.toml packages it; import-linter keeps it free of nodepool's code).

Quantities are written the Kubernetes way (``kubectl describe node``/``kubectl top``), from
nodepool's canonical integers (cpu millicores, bytes, counts; see ``nodepool.quantity``):

* cpu: whole cores ``"32"``, tenths of a core ``"2.1"``, otherwise millicores ``"2150m"``,
  ``"250m"`` — always exact, so ``2150`` is never shown as ``2.1``.
* bytes (memory, ephemeral-storage): the largest binary suffix with at most one decimal,
  ``"1.9Gi"``, ``"16Gi"``, ``"512Mi"``; below 1Ki the plain number of bytes (``"900"``).
  Rounded to one decimal (to nearest), like ``kubectl top``; exact when it divides.
* anything else (``nvidia.com/gpu``, ``pods``): the count as it is.

Times: one absolute format, ``2026-12-02 09:48:53 UTC`` (always UTC, seconds, no fraction), plus a
relative age as ``kubectl get`` prints it (``45s``, ``5m30s``, ``3h12m``, ``2d``; the rules of
k8s.io/apimachinery/pkg/util/duration ``HumanDuration``), and the two together,
``2026-12-02 09:48:53 UTC (12m ago)``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

__all__ = [
    "BYTE_RESOURCES",
    "CPU",
    "age",
    "duration",
    "moment",
    "parse_time",
    "percent",
    "quantity",
    "resources",
    "timestamp",
]

CPU = "cpu"
BYTE_RESOURCES = frozenset({"memory", "ephemeral-storage"})
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))
NONE = "-"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S UTC"


def quantity(resource: str, canonical: int | float | Decimal | None) -> str:
    """One canonical amount of ``resource`` in Kubernetes style.

    Args:
        resource: the resource name (``"cpu"``, ``"memory"``, ``"nvidia.com/gpu"``…).
        canonical: cpu in millicores, bytes for byte resources, a count otherwise; ``None`` → ``"-"``.

    Examples: ``quantity("cpu", 32000) == "32"``, ``quantity("cpu", 2100) == "2.1"``,
    ``quantity("cpu", 1488) == "1488m"``, ``quantity("memory", 2040109466) == "1.9Gi"``,
    ``quantity("memory", 17179869184) == "16Gi"``, ``quantity("nvidia.com/gpu", 8) == "8"``.
    """
    if canonical is None:
        return NONE
    if isinstance(canonical, float) and canonical.is_integer():
        canonical = int(canonical)
    value = Decimal(canonical)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if resource == CPU:
        if value % 1000 == 0:
            return f"{sign}{value // 1000}"
        if value >= 1000 and value % 100 == 0:
            return f"{sign}{value / 1000:.1f}"
        return f"{sign}{_plain(value)}m"
    if resource in BYTE_RESOURCES:
        larger = None  # rounding 1023.96Ki up gives 1024Ki: written 1Mi instead
        for suffix, size in _BINARY:
            if value >= size:
                scaled = (value / size).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
                if scaled >= 1024 and larger:
                    return f"{sign}1{larger}"
                return f"{sign}{_plain(scaled)}{suffix}"
            larger = suffix
        return f"{sign}{_plain(value)}"
    return f"{sign}{_plain(value)}"


def _plain(value: Decimal) -> str:
    """``Decimal`` without exponent or trailing zeros: ``2.0`` → ``"2"``, ``1.50`` → ``"1.5"``."""
    text = f"{value:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def resources(amounts: dict | None, *, separator: str = ", ") -> str:
    """A ``{resource: canonical}`` mapping as ``"cpu=2.1, memory=1.9Gi"`` (sorted); empty → ``"-"``."""
    if not amounts:
        return NONE
    return separator.join(f"{name}={quantity(name, value)}" for name, value in sorted(amounts.items()))


def percent(part: int | float, whole: int | float) -> str:
    """``part`` of ``whole`` as a whole percentage (``"30%"``); ``whole == 0`` → ``"-"``."""
    if not whole:
        return NONE
    return f"{round(100 * part / whole)}%"


def parse_time(value: datetime | str | None) -> datetime | None:
    """An aware ``datetime`` from a ``datetime`` or an RFC 3339 / ISO 8601 string (``Z`` allowed).

    A naive ``datetime`` is taken as UTC. ``None``, ``""`` and unparsable strings → ``None``.
    """
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value


def timestamp(value: datetime | str | None) -> str:
    """The one absolute format: ``"2026-12-02 09:48:53 UTC"``; ``None`` → ``"-"``."""
    parsed = parse_time(value)
    if parsed is None:
        return NONE if not value else str(value)
    return parsed.astimezone(UTC).strftime(TIME_FORMAT)


def duration(seconds: float | timedelta) -> str:
    """A duration as kubectl prints ages (``HumanDuration`` of k8s.io/apimachinery/pkg/util/duration).

    ``< 2m`` → ``"45s"``; ``< 10m`` → ``"5m30s"``; ``< 3h`` → ``"42m"``; ``< 8h`` → ``"3h12m"``;
    ``< 48h`` → ``"20h"``; ``< 8d`` → ``"3d4h"``; ``< 2y`` → ``"200d"``; ``< 8y`` → ``"3y20d"``;
    else ``"12y"``. A negative duration (clock skew) counts as ``"0s"``.
    """
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    total = max(0, int(seconds))
    if total < 120:
        return f"{total}s"
    minutes = total // 60
    if minutes < 10:
        rest = total % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        rest = hours % 24
        return f"{hours // 24}d{rest}h" if rest else f"{hours // 24}d"
    days = hours // 24
    if days < 365 * 2:
        return f"{days}d"
    years = days // 365
    if years < 8:
        rest = days % 365
        return f"{years}y{rest}d" if rest else f"{years}y"
    return f"{years}y"


def age(value: datetime | str | None, now: datetime | None = None) -> str:
    """How long ago ``value`` was, kubectl style (``"12m"``); ``None`` → ``"<none>"``.

    Args:
        value: an aware ``datetime`` or an RFC 3339 string.
        now: the reference time (default: the current UTC time); tests pass it.
    """
    parsed = parse_time(value)
    if parsed is None:
        return "<none>" if not value else str(value)
    return duration((now or datetime.now(UTC)) - parsed)


def moment(value: datetime | str | None, now: datetime | None = None) -> str:
    """Absolute time and age together: ``"2026-12-02 09:48:53 UTC (12m ago)"``; ``None`` → ``"never"``."""
    parsed = parse_time(value)
    if parsed is None:
        return "never" if not value else str(value)
    return f"{timestamp(parsed)} ({age(parsed, now)} ago)"
