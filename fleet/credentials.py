"""Issuing, rotating and revoking node credentials (short-lived, per node, stored hashed)."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from . import secrets as node_secrets
from .authentication import CREDENTIAL_KIND
from .models import Node, NodeCredential


def issue_credential(
    *, node: Node, issuer: str, agent_version: str = "", ttl_seconds: int | None = None, now=None
) -> tuple[NodeCredential, str]:
    """Create a credential for ``node``; returns ``(credential, secret)``. The secret is never stored.

    ``ttl_seconds`` defaults to ``NODEPOOL["CREDENTIAL_TTL"]`` (24 h).
    """
    now = now or timezone.now()
    ttl = ttl_seconds if ttl_seconds is not None else settings.NODEPOOL["CREDENTIAL_TTL"]
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
