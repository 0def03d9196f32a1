"""Issuing, rotating and revoking node credentials (short-lived, per node, stored hashed).

A node's credentials form a *lineage*: enrollment (or an operator) issues one, and each rotation
supersedes the credential it was made with (``superseded_by``). Only the newest credential of a
lineage may rotate; a superseded one keeps working for the rotation overlap (requests in flight)
and never again. Using it after the overlap means someone kept a copy of a secret its owner
replaced: the whole lineage is revoked and a security event recorded (OAuth 2.0 Security BCP,
RFC 9700 §4.14.2, refresh-token reuse detection). Everything lives in the database, so it holds
across web processes.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from . import conf, event_types
from . import secrets as node_secrets
from .events import Actor, record_event
from .models import Node, NodeCredential

CREDENTIAL_KIND = "npn"


def issue_credential(
    *, node: Node, issuer: str, agent_version: str = "", ttl_seconds: int | None = None, now=None
) -> tuple[NodeCredential, str]:
    """Create a credential for ``node``; returns ``(credential, secret)``. The secret is never stored.

    ``ttl_seconds`` defaults to ``NODEPOOL["CREDENTIAL_TTL"]`` (24 h).
    """
    now = now or timezone.now()
    ttl = ttl_seconds if ttl_seconds is not None else conf.get("CREDENTIAL_TTL")
    secret, prefix, digest = node_secrets.new_secret(CREDENTIAL_KIND)
    credential = NodeCredential.objects.create(
        node=node,
        prefix=prefix,
        secret_hash=digest,
        issuer=issuer[:150],
        agent_version=agent_version[:64],
        issued_at=now,
        expires_at=now + timedelta(seconds=ttl),
    )
    return credential, secret


def revoke_all_credentials(*, node: Node, now=None) -> int:
    """Revoke every unrevoked credential of ``node`` at once; other nodes are untouched. Returns count."""
    now = now or timezone.now()
    return NodeCredential.objects.filter(node=node, revoked_at__isnull=True).update(revoked_at=now)


def has_valid_credential(node: Node, now=None) -> bool:
    now = now or timezone.now()
    return NodeCredential.objects.filter(node=node, revoked_at__isnull=True, expires_at__gt=now).exists()


def is_superseded(credential: NodeCredential) -> bool:
    """True when a rotation replaced ``credential`` (it may no longer rotate)."""
    return credential.superseded_by_id is not None or credential.rotated_at is not None


def revoke_lineage_on_reuse(*, credential: NodeCredential, request_id: str = "", now=None) -> int:
    """A superseded credential was presented after its overlap: revoke the node's whole lineage.

    Every unrevoked credential of the node is revoked (the newest included: whoever holds the
    stale copy may also have stolen its successor) and one ``security`` event is recorded. The
    node's agent recovers by enrolling again with a bootstrap token (docs/fleet.md). Returns the
    number of credentials revoked (0 when an earlier request already did it).
    """
    now = now or timezone.now()
    with transaction.atomic():
        count = NodeCredential.objects.filter(node_id=credential.node_id, revoked_at__isnull=True).update(
            revoked_at=now
        )
        if count:
            record_event(
                credential.node,
                event_types.SECURITY,
                Actor.system("credential-reuse-detection", request_id),
                reason="a superseded node credential was used after its rotation overlap; lineage revoked",
                data={"credential": credential.prefix, "revoked": count, "rotated_at": _iso(credential.rotated_at)},
            )
    return count


def _iso(value) -> str | None:
    return value.isoformat() if value else None
