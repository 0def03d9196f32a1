"""User API tokens: hashed, expiring, sent as ``Authorization: Token <key>`` (django-rest-knox).

Only a SHA-512 digest of each token is stored (knox's ``AuthToken``); the key is shown once, when
it is made. Tokens expire after ``NODEPOOL_USER_TOKEN_TTL_DAYS`` (90 by default; 0 = never). New
keys read ``npu_<64 hex>``; keys migrated from Django REST framework's plaintext tokens keep their
old 40-hex form and keep working until they expire (migration ``nodepool.0001``).

With ``NODEPOOL_USER_TOKEN_SLIDING`` each use moves a token's expiry to now + the TTL (knox's
``AUTO_REFRESH``), never past its creation + ``NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS``.
:func:`log_out_everywhere` revokes every token of a user and ends their sessions
(``POST /api/v1/auth/logout-everywhere``, the operator's ``POST /api/v1/users/{username}/logout-everywhere``
and the admin's action on users).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.contrib.sessions.models import Session
from django.db import transaction
from django.utils import timezone
from knox.models import AuthToken


def user_token_ttl() -> timedelta | None:
    """The lifetime of a new user token (``None``: it never expires)."""
    days = settings.NODEPOOL_USER_TOKEN_TTL_DAYS
    return timedelta(days=days) if days > 0 else None


def max_lifetime() -> timedelta | None:
    """How long a sliding token may live from its creation (``None``: sliding is off, or unbounded)."""
    days = settings.NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS
    return timedelta(days=days) if settings.NODEPOOL_USER_TOKEN_SLIDING and days > 0 else None


def create_user_token(user, *, ttl: timedelta | None | str = "default", replace: bool = False) -> tuple[AuthToken, str]:
    """Make a token for ``user``; returns ``(stored_token, key)``. The key is never stored.

    Args:
        user: the Django user the token authenticates as.
        ttl: lifetime; ``"default"`` is :func:`user_token_ttl`, ``None`` never expires. With
            sliding refresh on, capped at :func:`max_lifetime` (a never-expiring token is not
            refreshed and keeps ``None``).
        replace: revoke (delete) the user's other tokens first, as ``drf_create_token -r`` did.
    """
    ttl = user_token_ttl() if ttl == "default" else ttl
    ceiling = max_lifetime()
    if ceiling is not None and ttl is not None:
        ttl = min(ttl, ceiling)
    with transaction.atomic():
        if replace:
            AuthToken.objects.filter(user=user).delete()
        return AuthToken.objects.create(user=user, expiry=ttl)


def log_out_everywhere(user) -> dict[str, int]:
    """Revoke (delete) every API token of ``user`` and end every session they are signed in
    with; returns ``{"tokens_revoked": n, "sessions_ended": m}``. A revoked token is refused as
    unknown (401 ``authentication_failed``), not ``token_expired``. Sessions are found by reading
    the unexpired database sessions (the admin's and the browsable API's; few on a control plane).
    """
    with transaction.atomic():
        tokens, _ = AuthToken.objects.filter(user=user).delete()
        ended = [
            session.pk
            for session in Session.objects.filter(expire_date__gt=timezone.now()).iterator()
            if str(session.get_decoded().get(SESSION_KEY)) == str(user.pk)
        ]
        Session.objects.filter(pk__in=ended).delete()
    return {"tokens_revoked": tokens, "sessions_ended": len(ended)}


def prune_expired_tokens(now=None) -> int:
    """Delete every user token expired more than ``NODEPOOL_EXPIRED_TOKEN_RETENTION_DAYS`` ago;
    returns how many (the ``nodepool.prune_expired_tokens`` task, hourly). Until then an expired
    token's digest is kept so that presenting it answers reason ``token_expired``; it is refused
    either way."""
    retention = timedelta(days=getattr(settings, "NODEPOOL_EXPIRED_TOKEN_RETENTION_DAYS", 30))
    deleted, _ = AuthToken.objects.filter(expiry__lt=(now or timezone.now()) - retention).delete()
    return deleted
