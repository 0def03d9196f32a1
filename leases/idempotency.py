"""Idempotency of ``POST /node-leases`` (the ``Idempotency-Key`` header): what an earlier call with
the same key produced, scoped to its client. Split out of :mod:`leases.services`.
"""

from __future__ import annotations

from typing import Any

from nodepool.api.problems import Unprocessable

from .errors import IDEMPOTENCY_KEY_REUSED
from .models import Lease, LeaseRequest


def replay(client, idempotency_key: str, request_hash: str) -> tuple[Any, int] | None:
    """The lease (or lease request) an earlier call with this key produced, or None.

    Raises:
        Unprocessable: the key was used with a different body (422 ``idempotency_key_reused``).
    """
    previous = Lease.objects.filter(client=client, idempotency_key=idempotency_key).first() or (
        LeaseRequest.objects.filter(client=client, idempotency_key=idempotency_key).first()
    )
    if previous is None:
        return None
    if previous.request_hash != request_hash:
        raise Unprocessable(
            "This Idempotency-Key was already used with a different request body.", IDEMPOTENCY_KEY_REUSED
        )
    return previous, 200
