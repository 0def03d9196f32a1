"""Pool policy: validation shared by the API serializers and the admin forms.

Every function raises :class:`fleet.capability.CapabilityError` (dotted field path + message).
"""

from __future__ import annotations

import math
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from nodepool.quantity import QuantityError, parse_resources

from .capability import CapabilityError, parse_features, parse_labels
from .errors import INVALID_QUANTITY

RESERVATION_CLASSES = ("system", "runtime", "monitoring", "failure_margin")


def parse_reservations(raw: Any, *, field: str = "reservations") -> dict[str, dict[str, int]]:
    """``{class: {resource: quantity}}`` → canonical ints; classes are :data:`RESERVATION_CLASSES`.

    Reservation classes follow Kubernetes' kube-reserved / system-reserved / eviction threshold
    split, plus a failure margin kept free for rescheduling after a node loss.
    """
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CapabilityError(field, "must be an object of reservation class to resources")
    out: dict[str, dict[str, int]] = {}
    for cls, resources in raw.items():
        if cls not in RESERVATION_CLASSES:
            raise CapabilityError(
                f"{field}.{cls}", f"unknown reservation class (known: {', '.join(RESERVATION_CLASSES)})"
            )
        try:
            out[cls] = parse_resources(resources or {}, field=f"{field}.{cls}")
        except QuantityError as exc:
            path, _, message = str(exc).partition(": ")
            raise CapabilityError(path, message or str(exc), INVALID_QUANTITY) from exc
    return out


def parse_required_capabilities(raw: Any, *, field: str = "required_capabilities") -> dict[str, Any]:
    """``{"resources": {name: quantity (minimum)}, "features": {...}}`` → canonical."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) - {"resources", "features"}:
        raise CapabilityError(field, "must be an object with resources and/or features")
    out: dict[str, Any] = {}
    if "resources" in raw:
        try:
            out["resources"] = parse_resources(raw["resources"] or {}, field=f"{field}.resources")
        except QuantityError as exc:
            path, _, message = str(exc).partition(": ")
            raise CapabilityError(path, message or str(exc), INVALID_QUANTITY) from exc
    if "features" in raw:
        out["features"] = parse_features(raw["features"], field=f"{field}.features")
    return out


def parse_required_labels(raw: Any, *, field: str = "required_labels") -> dict[str, str]:
    """Labels a node must carry; the value ``"*"`` means "present with any value"."""
    if raw is None:
        return {}
    if isinstance(raw, dict):
        plain = {k: ("" if v == "*" else v) for k, v in raw.items()}
        parse_labels(plain, field=field)
    else:
        parse_labels(raw, field=field)
    return dict(raw)


def parse_specifier(raw: Any, *, field: str = "allowed_agent_versions") -> str:
    """A PEP 440 specifier set such as ``">=1.0,<2"`` (empty allows any version)."""
    if raw is None or raw == "":
        return ""
    if not isinstance(raw, str) or len(raw) > 200:
        raise CapabilityError(field, "must be a PEP 440 specifier string such as '>=1.0,<2'")
    try:
        SpecifierSet(raw)
    except InvalidSpecifier as exc:
        raise CapabilityError(field, f"not a PEP 440 specifier: {exc}") from exc
    return raw


def load_attestation_key(pem: str, *, field: str = "attestation_public_key") -> Ed25519PublicKey:
    """Load an Ed25519 public key from PEM (SubjectPublicKeyInfo)."""
    try:
        key = load_pem_public_key(pem.encode())
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise CapabilityError(field, "not a PEM public key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise CapabilityError(field, "the attestation key must be Ed25519")
    return key


def check_timings(*, heartbeat_interval: int, heartbeat_grace: int, loss_threshold: int) -> None:
    """Liveness timings (seconds): interval ≥ 1, grace ≥ 2 × interval, loss threshold ≥ grace.

    A grace shorter than two intervals would call a node unreachable after one late heartbeat
    (Kubernetes' default grace, 40 s, is four 10 s intervals).
    """
    if heartbeat_interval < 1:
        raise CapabilityError("heartbeat_interval", "must be at least 1 second")
    if heartbeat_grace < 2 * heartbeat_interval:
        raise CapabilityError(
            "heartbeat_grace",
            f"must be at least twice the heartbeat interval ({2 * heartbeat_interval} s), got {heartbeat_grace} s",
        )
    if loss_threshold < heartbeat_grace:
        raise CapabilityError(
            "loss_threshold", f"must be at least the grace ({heartbeat_grace} s), got {loss_threshold} s"
        )


REVERIFICATION_MIN_SECONDS = 60
REVERIFICATION_MAX_SECONDS = 30 * 86400


def check_reverification(*, period: int | None, window: int, tolerance_percent: float) -> None:
    """A pool's re-verification schedule (fleet.reverification).

    ``period`` and ``window`` are seconds, each within 1 minute – 30 days, with ``window <=
    period`` (a window longer than the period would let two checks of one node overlap);
    ``period`` None turns re-verification off (the window and tolerance are still checked).
    ``tolerance_percent``: how far (0–100 %) a measurement may fall below verified.
    Raises :class:`CapabilityError` naming the field.
    """
    bounds = f"{REVERIFICATION_MIN_SECONDS} s (1 minute) to {REVERIFICATION_MAX_SECONDS} s (30 days)"
    for name, value in (("reverification_period", period), ("reverification_window", window)):
        if value is None and name == "reverification_period":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise CapabilityError(name, "must be a whole number of seconds")
        if not REVERIFICATION_MIN_SECONDS <= value <= REVERIFICATION_MAX_SECONDS:
            raise CapabilityError(name, f"must be from {bounds}, got {value} s")
    if period is not None and window > period:
        raise CapabilityError(
            "reverification_window", f"must not be longer than the period ({period} s), got {window} s"
        )
    if (
        isinstance(tolerance_percent, bool)
        or not isinstance(tolerance_percent, int | float)
        or not math.isfinite(tolerance_percent)
        or not 0 <= tolerance_percent <= 100
    ):
        raise CapabilityError("reverification_tolerance_percent", "must be a percentage from 0 to 100")


def check_pool(values: dict[str, Any]) -> None:
    """Cross-field rules of a whole pool (``values`` are the pool's fields after the change)."""
    check_timings(
        heartbeat_interval=values["heartbeat_interval"],
        heartbeat_grace=values["heartbeat_grace"],
        loss_threshold=values["loss_threshold"],
    )
    check_reverification(
        period=values.get("reverification_period"),
        window=values.get("reverification_window", 3600),
        tolerance_percent=values.get("reverification_tolerance_percent", 20.0),
    )
    tolerance = values.get("benchmark_tolerance", 0.8)
    if not (0 < tolerance <= 1):
        raise CapabilityError("benchmark_tolerance", "must be in (0, 1]")
    if values.get("attestation_public_key"):
        load_attestation_key(values["attestation_public_key"])
    elif values.get("attestation_required"):
        raise CapabilityError("attestation_public_key", "a pool that requires attestation needs a trusted key")
    allowed = values.get("allowed_undeclared_resources") or []
    if not isinstance(allowed, list) or len(allowed) > 32 or not all(isinstance(v, str) and v for v in allowed):
        raise CapabilityError("allowed_undeclared_resources", "must be a list of at most 32 resource names")
