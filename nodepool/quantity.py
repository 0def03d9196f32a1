"""Kubernetes quantity syntax and nodepool's canonical resource units.

Canonical units (integers, so that sums and comparisons are exact):

* ``cpu`` — millicores (``"500m"`` → 500, ``"2"`` → 2000, ``"1.5"`` → 1500)
* ``memory``, ``ephemeral-storage`` — bytes (``"4Gi"`` → 4294967296, ``"1k"`` → 1000)
* anything else (``nvidia.com/gpu``, ``pods``…) — a plain count (``"8"`` → 8)

The grammar is Kubernetes' ``resource.Quantity`` (k8s.io/apimachinery/pkg/api/resource,
``quantity.go``), exactly::

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <sign>            ::= "+" | "-"
    <digits>          ::= <digit> | <digit><digits>       (ASCII 0-9 only)
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedInteger> | "E" <signedInteger>

No spaces anywhere (Kubernetes refuses ``" 1"`` and ``"1 "`` too), at most 64 characters, and
an exponent of at most ±``MAX_EXPONENT``. nodepool is stricter than Kubernetes in two ways, both
refusals rather than silent changes: negative values are refused, and so is precision finer than
the resource's canonical unit (``"0.0001m"`` of cpu, ``"1.5"`` bytes of memory); Kubernetes
would round those up. Every failure of any kind is a :class:`QuantityError`.
"""

from __future__ import annotations

import re
from decimal import Decimal, DecimalException, localcontext

CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"
BYTE_RESOURCES = frozenset({MEMORY, EPHEMERAL_STORAGE})

# re.ASCII: \d would otherwise match Arabic-Indic or full-width digits ("١", "１"); fullmatch
# (not "$", which also matches before a final newline) so that nothing trails the suffix.
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?", re.ASCII
)
MAX_LENGTH = 64
# Largest |exponent| accepted in "1e<exp>": anything beyond cannot name a canonical value in
# range (2**62 < 1e19) or a precision nodepool keeps (1e-9 is the finest SI suffix).
MAX_EXPONENT = 30
# Decimal digits kept in arithmetic: 64 significant characters times 2**60 (19 digits) stay exact.
_PRECISION = 160
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
    """A quantity string (or number) that is not valid Kubernetes syntax, negative, or too large.

    From :func:`parse_resources`, ``field`` names the member (``resources.cpu``) and ``reason`` is
    the message without it: a resource name may itself hold a ``:``, so the message is not split.
    """

    def __init__(self, message: str, *, field: str = "", reason: str = ""):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = reason or message


def parse_decimal(value: str | int | float) -> Decimal:
    """Parse a quantity into an exact :class:`~decimal.Decimal` in base units (cores, bytes, count).

    Args:
        value: a quantity string (``"500m"``, ``"4Gi"``, ``"1e3"``), an int, or a finite float.

    Raises:
        QuantityError: not a string or number, not the grammar above (non-ASCII digits, spaces,
            unknown suffix), longer than ``MAX_LENGTH``, exponent beyond ``MAX_EXPONENT``, negative.
    """
    if isinstance(value, bool):
        raise QuantityError("a quantity cannot be a boolean")
    if isinstance(value, int | float):
        value = repr(value) if isinstance(value, float) else str(value)
    if not isinstance(value, str):
        raise QuantityError(f"a quantity must be a string or a number, not {type(value).__name__}")
    if len(value) > MAX_LENGTH:
        raise QuantityError(f"a quantity has at most {MAX_LENGTH} characters")
    match = _QUANTITY.fullmatch(value)
    if not match:
        raise QuantityError(f"{value!r} is not a quantity (examples: '500m', '2', '4Gi', '1.5')")
    number, suffix = match.group(1), match.group(2) or ""
    if suffix not in _BINARY and suffix not in _DECIMAL:  # a decimal exponent ("E" alone is exa)
        exponent = int(suffix[1:])
        if abs(exponent) > MAX_EXPONENT:
            raise QuantityError(f"{value!r}: the exponent must be between -{MAX_EXPONENT} and {MAX_EXPONENT}")
    try:
        with localcontext() as ctx:
            ctx.prec = _PRECISION
            amount = Decimal(number)
            if suffix in _BINARY:
                amount *= _BINARY[suffix]
            elif suffix in _DECIMAL:
                amount *= _DECIMAL[suffix]
            else:
                amount = amount.scaleb(int(suffix[1:]))
    except (DecimalException, ValueError) as exc:  # defensive: the bounds above keep it exact
        raise QuantityError(f"{value!r} is not a quantity") from exc
    if amount < 0:
        raise QuantityError(f"{value!r} is negative")
    return amount


def to_canonical(resource: str, value: str | int | float) -> int:
    """Convert a quantity for ``resource`` into nodepool's canonical integer unit.

    ``cpu`` becomes millicores, byte resources bytes, anything else a count.

    Raises:
        QuantityError: malformed, negative, larger than ``MAX_CANONICAL``, or finer than the
            canonical unit (``"0.0001m"`` cpu, ``"1.5"`` bytes, a fractional count): refused,
            never rounded.
    """
    amount = parse_decimal(value)
    if resource == CPU:
        with localcontext() as ctx:
            ctx.prec = _PRECISION  # the default 28 digits would round a long fraction to whole
            amount = amount.scaleb(3)
        units = "millicores (1m)"
    elif resource in BYTE_RESOURCES:
        units = "bytes"
    else:
        units = "whole units"
    if amount > MAX_CANONICAL:
        raise QuantityError(f"{value!r} is too large")
    if amount != amount.to_integral_value():
        raise QuantityError(f"{resource} is counted in {units}; {value!r} is finer than that")
    return int(amount)


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
        QuantityError: with the offending key in ``field`` and in the message, as ``"<field>.<name>: ..."``.
    """
    if not isinstance(resources, dict):
        raise QuantityError("must be an object of resource name to quantity", field=field)
    out: dict[str, int] = {}
    for name, value in resources.items():
        if not isinstance(name, str) or not RESOURCE_NAME.fullmatch(name):
            raise QuantityError("not a valid resource name", field=f"{field}.{name}")
        try:
            out[name] = to_canonical(name, value)
        except QuantityError as exc:
            raise QuantityError(str(exc), field=f"{field}.{name}") from exc
    return out
