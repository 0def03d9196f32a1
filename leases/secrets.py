"""Per-lease secrets: derived, never stored (docs/marketplace.md, "Per-lease secrets").

A lease's secret is an HMAC-SHA256, under a server key, over the lease id, the workload id, the
fencing token and an expiry (the lease's ``expires_at``, whole seconds). It is sent with the text it
covers, so anyone holding the key can verify it without a table of secrets, and the control plane
can re-send it at every status report without keeping it in clear::

    npls.<lease id>.<fencing token>.<expiry, unix seconds>.<MAC, base64url without padding>

A renewal moves the lease's expiry, so the agent receives a fresh secret with the next heartbeat;
the old one stays valid until its own expiry while the lease is live with that token. A secret is
rejected once it expires, once its lease ends (released, expired, lost, revoked), and once a newer
lease of the workload exists (the fencing validation, :func:`leases.selectors.fence_status`).

The key is ``NODEPOOL["LEASE_SECRET_KEY"]`` (environment ``NODEPOOL_LEASE_SECRET_KEY``); without one
it is derived from ``SECRET_KEY`` with HMAC under a fixed label, so the Django key itself is never
an input to a MAC that leaves the server.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.utils import timezone

from . import conf
from .models import Lease
from .selectors import fence_status

PREFIX = "npls"
MAX_LENGTH = 200

# Stable codes of a verification (``fencing/validate`` answers them as ``code``).
VALID = "valid"
MALFORMED = "malformed_lease_secret"
BAD_SIGNATURE = "bad_lease_secret"
EXPIRED = "lease_secret_expired"
STALE = "stale_lease_secret"


def _key() -> bytes:
    configured = conf.get("LEASE_SECRET_KEY")
    if configured:
        return configured.encode()
    return hmac.new(settings.SECRET_KEY.encode(), b"nodepool lease secrets v1", hashlib.sha256).digest()


def _mac(lease_id: str, workload_id: str, fencing_token: int, expiry: int) -> str:
    message = f"{lease_id}\n{workload_id}\n{fencing_token}\n{expiry}".encode()
    digest = hmac.new(_key(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def lease_secret(*, lease_id, workload_id: str, fencing_token: int, expires_at: datetime) -> tuple[str, datetime]:
    """The secret of one lease as it stands. Returns ``(secret, expires_at truncated to seconds)``."""
    expiry = int(expires_at.timestamp())
    lease_id = str(lease_id)
    secret = f"{PREFIX}.{lease_id}.{fencing_token}.{expiry}.{_mac(lease_id, workload_id, fencing_token, expiry)}"
    return secret, datetime.fromtimestamp(expiry, tz=UTC)


def secret_for(lease) -> str:
    """The current secret of a Lease."""
    return lease_secret(
        lease_id=lease.pk, workload_id=lease.workload_id, fencing_token=lease.fencing_token, expires_at=lease.expires_at
    )[0]


@dataclass(frozen=True)
class SecretCheck:
    """The answer of :func:`verify_lease_secret`: ``valid`` and a stable ``code``; the lease
    (``lease_id``, ``workload_id``, ``fencing_token``) when the secret named one we know."""

    valid: bool
    code: str
    lease_id: str | None = None
    workload_id: str | None = None
    fencing_token: int | None = None
    expires_at: datetime | None = None
    current_token: int | None = None

    def as_dict(self) -> dict:
        return {
            "valid": self.valid,
            "code": self.code,
            "lease_id": self.lease_id,
            "workload_id": self.workload_id,
            "fencing_token": self.fencing_token,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "current_token": self.current_token,
        }


def _parse(secret) -> tuple[str, int, int, str] | None:
    if not isinstance(secret, str) or len(secret) > MAX_LENGTH:
        return None
    parts = secret.split(".")
    if len(parts) != 5 or parts[0] != PREFIX:
        return None
    _, lease_id, token, expiry, mac = parts
    try:
        lease_id = str(uuid.UUID(lease_id))
    except ValueError:
        return None
    if not (token.isascii() and token.isdigit() and expiry.isascii() and expiry.isdigit()) or len(token) > 19:
        return None
    if len(expiry) > 12:
        return None
    return lease_id, int(token), int(expiry), mac


def verify_lease_secret(secret, *, now: datetime | None = None) -> SecretCheck:
    """Is ``secret`` the secret of a live lease, with that lease's current fencing token, unexpired?

    The check other services call (``POST /fencing/validate`` with ``{"lease_secret"}`` answers the
    same). Never raises on bad input: a malformed secret is ``valid: false, code:
    malformed_lease_secret``. Codes: ``valid``, ``malformed_lease_secret``, ``bad_lease_secret``
    (the MAC does not match: forged, made with another server key, or naming no lease we know —
    the same answer, so lease ids cannot be probed), ``lease_secret_expired``,
    ``stale_lease_secret`` (the lease ended or a newer lease of the workload holds a larger fencing
    token; the fencing validation decided). Details of the lease come back only with a valid MAC.
    """
    now = now or timezone.now()
    parsed = _parse(secret)
    if parsed is None:
        return SecretCheck(False, MALFORMED)
    lease_id, token, expiry, mac = parsed
    row = Lease.objects.filter(pk=lease_id).values("workload_id").first()
    if row is None:
        # Told apart from a forged secret only by who can sign: an unknown id says nothing more.
        return SecretCheck(False, BAD_SIGNATURE)
    expected = _mac(lease_id, row["workload_id"], token, expiry)
    if not hmac.compare_digest(expected, mac):
        return SecretCheck(False, BAD_SIGNATURE)
    expires_at = datetime.fromtimestamp(expiry, tz=UTC)
    found = {"lease_id": lease_id, "workload_id": row["workload_id"], "fencing_token": token, "expires_at": expires_at}
    if expires_at <= now:
        return SecretCheck(False, EXPIRED, **found)
    fence = fence_status(row["workload_id"], token)
    if not fence["valid"] or fence["lease_id"] != lease_id:
        return SecretCheck(False, STALE, current_token=fence["current_token"], **found)
    return SecretCheck(True, VALID, current_token=fence["current_token"], **found)


def lease_secret_verifier(lease, secret) -> bool:
    """The verifier registered with :func:`leases.fencing.register_lease_secret_verifier`: does
    ``secret`` belong to ``lease`` (same id, workload and fencing token, MAC valid, unexpired)?

    Lets a caller holding a lease's own secret validate that lease's fencing token; compares the
    MAC in constant time (``hmac.compare_digest``)."""
    parsed = _parse(secret)
    if parsed is None:
        return False
    lease_id, token, expiry, mac = parsed
    if lease_id != str(lease.pk) or token != lease.fencing_token:
        return False
    if not hmac.compare_digest(_mac(lease_id, lease.workload_id, token, expiry), mac):
        return False
    return datetime.fromtimestamp(expiry, tz=UTC) > timezone.now()
