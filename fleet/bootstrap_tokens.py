"""Bootstrap tokens (writes): the pool-scoped enrollment secrets — their rules, creation,
revocation and the conditional spend enrollment and takeover make (split from fleet.services,
issue 28 step 8).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import F
from django.utils import timezone

from nodepool.api.problems import Forbidden, NotFound, Problem

from . import clock, takeover
from . import secrets as node_secrets
from .choices import PoolKind
from .errors import (
    BOOTSTRAP_TOKEN_EXHAUSTED,
    BOOTSTRAP_TOKEN_EXPIRED,
    BOOTSTRAP_TOKEN_INVALID,
    BOOTSTRAP_TOKEN_NOT_FOUND,
    BOOTSTRAP_TOKEN_REVOKED,
    BOOTSTRAP_TOKEN_WRONG_NODE,
    BOOTSTRAP_TOKEN_WRONG_POOL,
    INVALID_EXPIRY,
    INVALID_MAX_USES,
    OWNER_REQUIRED,
)
from .models import BootstrapToken, Pool

BOOTSTRAP_KIND = "npb"
MAX_BOOTSTRAP_TTL = timedelta(days=365)


# --- bootstrap tokens ------------------------------------------------------------------------------


def bootstrap_token_validate(*, pool: Pool, expires_at: datetime, max_uses: int, owner=None, now=None) -> None:
    """The rules of a new bootstrap token (shared with the admin form); raises :class:`Problem` (400)."""
    now = now or timezone.now()
    if expires_at <= now or expires_at - now > MAX_BOOTSTRAP_TTL:
        raise Problem("expires_at must be in the future and at most a year ahead.", INVALID_EXPIRY)
    if max_uses < 1 or max_uses > 100_000:
        raise Problem("max_uses must be between 1 and 100000.", INVALID_MAX_USES)
    if pool.kind == PoolKind.MARKETPLACE and owner is None:
        raise Problem("A marketplace pool's bootstrap token must name its owner.", OWNER_REQUIRED)


def bootstrap_token_create(
    *,
    pool: Pool | None,
    expires_at: datetime,
    max_uses: int = 1,
    description: str = "",
    owner=None,
    created_by=None,
    node_id=None,
    now: datetime | None = None,
) -> tuple[BootstrapToken, str]:
    """Create a bootstrap token; returns ``(token, secret)``. The secret is shown once, stored hashed.

    ``node_id``: the token names that node (fleet.takeover): an agent enrolling with it takes the
    node over instead of enrolling a new one. Its pool and owner are the node's (``pool`` may be
    None), and it is used once.

    Raises:
        Problem 400 ``invalid_expiry`` (past, or more than a year ahead), ``invalid_max_uses``,
        ``owner_required`` (a marketplace pool's token must name the contributor whose nodes it enrolls);
        with ``node_id``: 400 ``unknown_node``, 400 ``node_pool_mismatch``, 400 ``invalid_max_uses``
        (not 1), 410 ``node_retired``, 409 ``node_quarantined``.
    """
    node = None
    if node_id is not None:
        node, pool = takeover.token_node(node_id=node_id, pool=pool)
        takeover.check_max_uses(max_uses)
        owner = node.owner
    bootstrap_token_validate(pool=pool, expires_at=expires_at, max_uses=max_uses, owner=owner, now=now)
    secret, prefix, digest = node_secrets.new_secret(BOOTSTRAP_KIND)
    token = BootstrapToken.objects.create(
        pool=pool,
        description=description[:200],
        prefix=prefix,
        secret_hash=digest,
        expires_at=expires_at,
        max_uses=max_uses,
        owner=owner,
        created_by=created_by,
        node=node,
    )
    return token, secret


def bootstrap_token_revoke(*, token_id: int, now: datetime | None = None) -> BootstrapToken:
    """Revoke a token (idempotent: the first revocation time stays). Raises 404."""
    now = now or timezone.now()
    BootstrapToken.objects.filter(pk=token_id, revoked_at__isnull=True).update(revoked_at=now)
    token = BootstrapToken.objects.filter(pk=token_id).first()
    if token is None:
        raise NotFound("No such bootstrap token.", BOOTSTRAP_TOKEN_NOT_FOUND)
    return token


def _bootstrap_refused(detail: str, code: str) -> Forbidden:
    return Forbidden(detail, code)


def bootstrap_token_use(
    *, secret: str, expected_pool: str | None = None, expected_node: str | None = None, now: datetime | None = None
) -> BootstrapToken:
    """Spend one use of the bootstrap token ``secret``. Call inside the enrollment transaction.

    ``expected_node`` (a node id as the agent sent it): the agent means to take over that node, so
    the token must name exactly it.

    The spend is one conditional UPDATE (``uses = uses + 1 WHERE uses < max_uses AND not expired
    AND not revoked``), so two enrollments racing for the last use cannot both win, on SQLite and
    PostgreSQL alike; the loser's reason is read afterwards.

    Raises (403, nothing spent): ``bootstrap_token_invalid`` (malformed or unknown),
    ``bootstrap_token_expired``, ``bootstrap_token_revoked``, ``bootstrap_token_exhausted``,
    ``bootstrap_token_wrong_pool`` (the enrollment names another pool than the token's),
    ``bootstrap_token_wrong_node`` (``expected_node`` is sent and the token names another node, or none).
    """
    now = now or timezone.now()
    prefix = node_secrets.split_prefix(secret, BOOTSTRAP_KIND) if isinstance(secret, str) else None
    token = BootstrapToken.objects.select_related("pool").filter(prefix=prefix).first() if prefix else None
    if token is None or not node_secrets.matches(secret, token.secret_hash):
        raise _bootstrap_refused("Unknown bootstrap token.", BOOTSTRAP_TOKEN_INVALID)
    if expected_pool is not None and expected_pool != token.pool.name:
        raise _bootstrap_refused(
            f"This bootstrap token enrolls into pool {token.pool.name!r}, not {expected_pool!r}.",
            BOOTSTRAP_TOKEN_WRONG_POOL,
        )
    if expected_node is not None and str(expected_node) != str(token.node_id or ""):
        # Never says whether the node exists: the caller is not authenticated yet.
        named = "names no node (it enrolls new nodes)" if token.node_id is None else "names another node"
        raise _bootstrap_refused(f"This bootstrap token {named}, not node {expected_node!s:.64}.",
                                 BOOTSTRAP_TOKEN_WRONG_NODE)  # fmt: skip
    # Expiry at control-plane time: a forward clock jump not yet detected must not expire it.
    valid_at = now if token.expires_at > now else clock.control_plane_now(now)
    spent = BootstrapToken.objects.filter(
        pk=token.pk, uses__lt=F("max_uses"), expires_at__gt=valid_at, revoked_at__isnull=True
    ).update(uses=F("uses") + 1)
    if spent:
        return token
    token.refresh_from_db()
    if token.revoked_at is not None:
        raise _bootstrap_refused("This bootstrap token was revoked.", BOOTSTRAP_TOKEN_REVOKED)
    if token.expires_at <= valid_at:
        raise _bootstrap_refused("This bootstrap token expired.", BOOTSTRAP_TOKEN_EXPIRED)
    raise _bootstrap_refused("This bootstrap token has no uses left.", BOOTSTRAP_TOKEN_EXHAUSTED)
