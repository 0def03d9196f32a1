"""Kubernetes quantity syntax and nodepool's canonical resource units.

Canonical units (integers, so that sums and comparisons are exact):

* ``cpu`` — millicores (``"500m"`` → 500, ``"2"`` → 2000, ``"1.5"`` → 1500)
* ``memory``, ``ephemeral-storage`` — bytes (``"4Gi"`` → 4294967296, ``"1k"`` → 1000)
* anything else (``nvidia.com/gpu``, ``pods``…) — a plain count (``"8"`` → 8)

The grammar is Kubernetes' ``resource.Quantity`` (k8s.io/apimachinery/pkg/api/resource):
a signed decimal number followed by a binary suffix (Ki Mi Gi Ti Pi Ei), a decimal suffix
(n u m "" k M G T P E) or a decimal exponent (``e3``/``E3``). nodepool refuses negative values.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"
BYTE_RESOURCES = frozenset({MEMORY, EPHEMERAL_STORAGE})

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
# Resource names: Kubernetes' qualified names ("cpu", "nvidia.com/gpu", "hugepages-2Mi").
RESOURCE_NAME = re.compile(r"^(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
MAX_CANONICAL = 2**62  # fits a signed 64-bit column with room for sums


class QuantityError(ValueError):
    """A quantity string (or number) that is not valid Kubernetes syntax, negative, or too large."""


def parse_decimal(value: str | int | float) -> Decimal:
    """Parse a quantity into an exact :class:`~decimal.Decimal` in base units (cores, bytes, count).

    Raises:
        QuantityError: malformed, negative, or not finite.
    """
    if isinstance(value, bool):
        raise QuantityError("a quantity cannot be a boolean")
    if isinstance(value, int | float):
        value = repr(value) if isinstance(value, float) else str(value)
    if not isinstance(value, str):
        raise QuantityError(f"a quantity must be a string or a number, not {type(value).__name__}")
    text = value.strip()
    match = _QUANTITY.match(text)
    if not match or len(text) > 64:
        raise QuantityError(f"{value!r} is not a quantity (examples: '500m', '2', '4Gi', '1.5')")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        amount = Decimal(number)
    except InvalidOperation as exc:  # pragma: no cover - the regex already guarantees digits
        raise QuantityError(f"{value!r} is not a quantity") from exc
    if suffix in _BINARY:
        amount *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        amount *= _DECIMAL[suffix]
    else:
        amount = amount.scaleb(int(suffix[1:]))
    if amount < 0:
        raise QuantityError(f"{value!r} is negative")
    return amount


def to_canonical(resource: str, value: str | int | float) -> int:
    """Convert a quantity for ``resource`` into nodepool's canonical integer unit.

    ``cpu`` becomes millicores, byte resources bytes, anything else a count. Fractions round up
    (Kubernetes rounds requests up to the smallest unit it can represent).

    Raises:
        QuantityError: malformed, negative, too large, or a fractional count of a counted resource.
    """
    amount = parse_decimal(value)
    if resource == CPU:
        amount *= 1000
    elif resource not in BYTE_RESOURCES and amount != amount.to_integral_value():
        raise QuantityError(f"{resource} is counted in whole units; {value!r} is fractional")
    result = int(amount.to_integral_value(rounding=ROUND_CEILING))
    if result > MAX_CANONICAL:
        raise QuantityError(f"{value!r} is too large")
    return result


def format_quantity(resource: str, canonical: int) -> str:
    """Render a canonical integer back in Kubernetes syntax (``1500`` cpu → ``"1500m"``)."""
    if resource == CPU:
        return f"{canonical // 1000}" if canonical % 1000 == 0 else f"{canonical}m"
    if resource in BYTE_RESOURCES:
        for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
            if canonical and canonical % _BINARY[suffix] == 0:
                return f"{canonical // _BINARY[suffix]}{suffix}"
    return str(canonical)


def parse_resources(resources: dict, *, field: str = "resources") -> dict[str, int]:
    """Validate and convert a ``{name: quantity}`` mapping to canonical integers.

    Raises:
        QuantityError: with the offending key in the message, as ``"<field>.<name>: ..."``.
    """
    if not isinstance(resources, dict):
        raise QuantityError(f"{field}: must be an object of resource name to quantity")
    out: dict[str, int] = {}
    for name, value in resources.items():
        if not isinstance(name, str) or not RESOURCE_NAME.match(name):
            raise QuantityError(f"{field}.{name}: not a valid resource name")
        try:
            out[name] = to_canonical(name, value)
        except QuantityError as exc:
            raise QuantityError(f"{field}.{name}: {exc}") from exc
    return out
