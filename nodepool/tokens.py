"""User API tokens: hashed, expiring, sent as ``Authorization: Token <key>`` (django-rest-knox).

Only a SHA-512 digest of each token is stored (knox's ``AuthToken``); the key is shown once, when
it is made. Tokens expire after ``NODEPOOL_USER_TOKEN_TTL_DAYS`` (90 by default; 0 = never). New
keys read ``npu_<64 hex>``; keys migrated from Django REST framework's plaintext tokens keep their
old 40-hex form and keep working until they expire (migration ``nodepool.0001``).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from knox.models import AuthToken


def user_token_ttl() -> timedelta | None:
    """The lifetime of a new user token (``None``: it never expires)."""
    days = settings.NODEPOOL_USER_TOKEN_TTL_DAYS
    return timedelta(days=days) if days > 0 else None


def create_user_token(user, *, ttl: timedelta | None | str = "default", replace: bool = False) -> tuple[AuthToken, str]:
    """Make a token for ``user``; returns ``(stored_token, key)``. The key is never stored.

    Args:
        user: the Django user the token authenticates as.
        ttl: lifetime; ``"default"`` is :func:`user_token_ttl`, ``None`` never expires.
        replace: revoke (delete) the user's other tokens first, as ``drf_create_token -r`` did.
    """
    with transaction.atomic():
        if replace:
            AuthToken.objects.filter(user=user).delete()
        return AuthToken.objects.create(user=user, expiry=user_token_ttl() if ttl == "default" else ttl)


def prune_expired_tokens(now=None) -> int:
    """Delete every user token expired more than ``NODEPOOL_EXPIRED_TOKEN_RETENTION_DAYS`` ago;
    returns how many (the ``nodepool.prune_expired_tokens`` task, hourly). Until then an expired
    token's digest is kept so that presenting it answers reason ``token_expired``; it is refused
    either way."""
    from django.utils import timezone

    retention = timedelta(days=getattr(settings, "NODEPOOL_EXPIRED_TOKEN_RETENTION_DAYS", 30))
    deleted, _ = AuthToken.objects.filter(expiry__lt=(now or timezone.now()) - retention).delete()
    return deleted
