"""Numeric comparisons written by people: ``>= 40Gi``, ``<= 2``, ``>= 0.99``.

One small grammar shared by every request that compares a number: device attribute constraints
(leases.device_requests: ``memory >= 40Gi``) and, later, node reliability (``reliability >= 0.99``).
A value is a number or a Kubernetes quantity string (``"40Gi"``, ``"500m"``, ``"1.5"``); operators
are ``=``, ``!=``, ``>``, ``>=``, ``<``, ``<=``. Parsing raises :class:`ComparisonError`, which
callers turn into a 400 naming their field.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

NUMERIC_OPERATORS = ("=", "!=", ">", ">=", "<", "<=")
_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


class ComparisonError(ValueError):
    """A malformed operator or value."""


def parse_number(value) -> Decimal:
    """A JSON number or a quantity string (``"40Gi"``, ``"0.99"``, ``"1e3"``) → Decimal.

    Raises:
        ComparisonError: not a finite number or quantity (booleans are refused).
    """
    if isinstance(value, bool) or value is None:
        raise ComparisonError("must be a number or a quantity such as 40Gi")
    if isinstance(value, int | float):
        number = Decimal(str(value))
    elif isinstance(value, str) and 0 < len(value) <= 64:
        text = value.strip()
        factor: int | Decimal = 1
        for suffix in sorted(_SUFFIXES, key=len, reverse=True):
            if text.endswith(suffix):
                factor, text = _SUFFIXES[suffix], text[: -len(suffix)]
                break
        try:
            number = Decimal(text) * factor
        except InvalidOperation as exc:
            raise ComparisonError(f"{value!r} is not a number or a quantity such as 40Gi") from exc
    else:
        raise ComparisonError("must be a number or a quantity such as 40Gi")
    if not number.is_finite():
        raise ComparisonError("must be finite")
    return number


@dataclass(frozen=True)
class Comparison:
    """``actual <operator> value``; :meth:`holds` is False for a missing (None) or non-numeric actual."""

    operator: str
    value: Decimal

    @classmethod
    def parse(cls, operator, value) -> Comparison:
        """Raises :class:`ComparisonError` for an unknown operator or a bad value."""
        if operator not in NUMERIC_OPERATORS:
            raise ComparisonError(f"operator must be one of {', '.join(NUMERIC_OPERATORS)}")
        return cls(operator, parse_number(value))

    def holds(self, actual) -> bool:
        if actual is None or isinstance(actual, bool):
            return False
        try:
            number = parse_number(actual)
        except ComparisonError:
            return False
        return {
            "=": number == self.value,
            "!=": number != self.value,
            ">": number > self.value,
            ">=": number >= self.value,
            "<": number < self.value,
            "<=": number <= self.value,
        }[self.operator]
