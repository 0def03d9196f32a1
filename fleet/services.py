"""Fleet services (writes): pools, bootstrap tokens, enrollment, node credentials, admission start.

Each service runs ``atomic()`` → lock or compare-and-swap → check version / ``can_proceed`` →
change → ``save(update_fields=...)`` → :func:`fleet.events.record_event`, and raises
:class:`nodepool.api.problems.Problem` subclasses with stable codes. Admission checks and
benchmarks live in :mod:`fleet.admission`.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Greatest
from django.utils import timezone
from django_fsm import can_proceed

from nodepool import failsafe
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, Forbidden, Gone, NotFound, Problem, TooManyRequests
from nodepool.api.versioning import check_version
from nodepool.celery import app as celery_app

from . import clock, conf, event_types, takeover
from . import devices as device_inventory
from . import secrets as node_secrets
from . import taints as taint_times
from .capability import CapabilityError
from .choices import ActorType, AdmissionMode, Lifecycle, PoolKind
from .credentials import is_superseded, issue_credential, revoke_all_credentials
from .devices import parse_devices
from .errors import (
    BOOTSTRAP_TOKEN_EXHAUSTED,
    BOOTSTRAP_TOKEN_EXPIRED,
    BOOTSTRAP_TOKEN_INVALID,
    BOOTSTRAP_TOKEN_NOT_FOUND,
    BOOTSTRAP_TOKEN_REVOKED,
    BOOTSTRAP_TOKEN_WRONG_NODE,
    BOOTSTRAP_TOKEN_WRONG_POOL,
    CREDENTIAL_SUPERSEDED,
    INVALID_EXPIRY,
    INVALID_MAX_USES,
    INVALID_POOL_POLICY,
    NODE_NOT_FOUND,
    NODE_QUARANTINED,
    NODE_RETIRED,
    OWNER_REQUIRED,
    POOL_EXISTS,
    POOL_HAS_NODES,
    POOL_NOT_FOUND,
    ROTATION_THROTTLED,
)
from .events import Actor, event_row, record_event
from .instructions import Instruction, post_instructions
from .models import BootstrapToken, Node, NodeCredential, NodeEvent, NodeResource, Pool
from .policy import check_pool

BOOTSTRAP_KIND = "npb"
MAX_BOOTSTRAP_TTL = timedelta(days=365)


# --- pools -----------------------------------------------------------------------------------


def _validate_pool(pool: Pool) -> None:
    try:
        check_pool({f.attname: getattr(pool, f.attname) for f in Pool._meta.concrete_fields})
    except CapabilityError as exc:
        raise Problem(exc.message, INVALID_POOL_POLICY, errors=[{"field": exc.field, "message": exc.message}]) from exc


def pool_create(*, values: dict[str, Any]) -> Pool:
    """Create a pool from already parsed values (canonical units). Raises 400 ``invalid_pool_policy``."""
    pool = Pool(**values)
    _validate_pool(pool)
    if Pool.objects.filter(name=pool.name).exists():
        raise Conflict(f"A pool named {pool.name!r} exists.", POOL_EXISTS)
    pool.save()
    return pool


def pool_update(*, pool_id: int, expected_version: int, changes: dict[str, Any], actor: Actor) -> Pool:
    """Change pool policy with optimistic concurrency; reservation changes recompute allocatable.

    Raises:
        NotFound (404), PreconditionFailed (412 ``version_mismatch``), Problem (400 ``invalid_pool_policy``).
    """
    with transaction.atomic():
        # FOR NO KEY UPDATE: a node action or a grant inserting a row that names the pool (an
        # event, a lease) takes FOR KEY SHARE on it while it holds its node; FOR UPDATE would make
        # it wait here while this waits for its node below (a deadlock).
        pool = Pool.objects.select_for_update(no_key=True).filter(pk=pool_id).first()
        if pool is None:
            raise NotFound("No such pool.", POOL_NOT_FOUND)
        check_version(pool.version, expected_version)
        old_reservations, old_labels, old_taints = pool.reservations, pool.labels, pool.taints
        for name, value in changes.items():
            setattr(pool, name, value)
        _validate_pool(pool)
        pool.version += 1
        pool.save(update_fields=[*changes, "version", "updated_at"])
        reservations_changed = "reservations" in changes and changes["reservations"] != old_reservations
        if reservations_changed or pool.labels != old_labels or pool.taints != old_taints:
            # Every member node before any of its rows, in one order: a grant holds its node, then
            # updates the node's resources; recomputing them first would be the opposite order.
            lock_members(pool)
        if reservations_changed:
            node_resources_recompute(pool=pool, actor=actor)
        if pool.labels != old_labels or pool.taints != old_taints:
            nodes_apply_pool_labels(pool=pool, old_labels=old_labels, old_taints=old_taints, actor=actor)
    return pool


def lock_members(pool: Pool) -> None:
    """Lock every node of ``pool`` (``FOR NO KEY UPDATE``, in primary-key order, as every
    multi-node lock does). Call inside a transaction, before touching rows that hang off them."""
    list(Node.objects.select_for_update(no_key=True).filter(pool=pool).order_by("pk").values_list("pk", flat=True))


def nodes_apply_pool_labels(*, pool: Pool, old_labels: dict, old_taints: list, actor: Actor) -> int:
    """Carry a change of the pool's labels and taints to every member's platform labels and taints.

    A label or taint the pool used to apply is removed from a node only where the node still has
    the pool's old value (an operator's own change on that node is kept); the pool's new labels and
    taints are then applied. Row by row (JSON merge), one ``policy`` event per node changed.
    Returns the number of nodes changed. Call inside the transaction that changed the pool.
    """
    changed = 0
    now = timezone.now()
    nodes = (
        Node.objects.select_for_update(no_key=True)
        .filter(pool=pool)
        .order_by("pk")
        .only("pk", "labels", "taints", "taints_added_at", "version")
    )
    for node in nodes:
        labels = {k: v for k, v in (node.labels or {}).items() if old_labels.get(k) != v or k in pool.labels}
        labels.update(pool.labels or {})
        taints = [t for t in (node.taints or []) if t not in old_taints and t not in pool.taints]
        taints = [*pool.taints, *taints]
        if labels == node.labels and taints == node.taints:
            continue
        Node.objects.filter(pk=node.pk).update(
            labels=labels, taints=taints, taints_added_at=taint_times.stamp(node.taints_added_at, taints, now),
            version=F("version") + 1,
        )  # fmt: skip
        record_event(node, event_types.POLICY, actor, reason="pool labels or taints changed",
                     data={"labels": labels, "taints": taints})  # fmt: skip
        changed += 1
    return changed


def pool_delete(*, pool_id: int, expected_version: int) -> None:
    """Delete an empty pool. Raises 404, 412, or 409 ``pool_has_nodes``."""
    with transaction.atomic():
        pool = Pool.objects.select_for_update().filter(pk=pool_id).first()
        if pool is None:
            raise NotFound("No such pool.", POOL_NOT_FOUND)
        check_version(pool.version, expected_version)
        if pool.nodes.exists():
            raise Conflict("The pool still has nodes; retire and remove them first.", POOL_HAS_NODES)
        pool.delete()


def node_resources_recompute(*, pool: Pool, actor: Actor | None = None) -> int:
    """Apply ``pool``'s reservations to every node's inventory: ``allocatable = max(0, capacity - reserved)``.

    Set-based: one UPDATE per reserved resource plus one for the rest; ``allocated`` is untouched
    (a node whose allocatable drops below allocated shows as overcommitted, its leases stay).
    Records one ``policy`` event per node in the pool. Returns the number of inventory rows changed.
    Call inside the transaction that changed the reservations.
    """
    actor = actor or Actor.system("fleet.node_resources_recompute")
    totals = pool.reserved_totals()
    rows = NodeResource.objects.filter(node__pool=pool)
    changed = rows.exclude(name__in=list(totals)).update(reserved=0, allocatable=F("capacity"))
    for name, reserved in totals.items():
        changed += rows.filter(name=name).update(
            reserved=reserved, allocatable=Greatest(F("capacity") - Value(reserved), Value(0))
        )
    node_ids = list(pool.nodes.values_list("pk", flat=True))
    Node.objects.filter(pk__in=node_ids).update(version=F("version") + 1)
    NodeEvent.objects.bulk_create(
        [
            event_row(node_id, event_types.POLICY, actor, reason="pool reservations changed", data={"reserved": totals})
            for node_id in node_ids
        ]
    )
    return changed


def node_inventory_set(*, node: Node, resources: dict[str, int]) -> None:
    """Set the capacity inventory of ``node`` from ``resources`` (verified, canonical ints).

    Reserved comes from the pool's reservations; ``allocated`` of existing rows is kept (a node
    returning from maintenance may still hold accounting from leases being reconciled); a resource
    no longer verified keeps its row at capacity 0 so that its allocation stays visible.
    """
    reserved = node.pool.reserved_totals()
    existing = {r.name: r for r in NodeResource.objects.filter(node=node)}
    for name, capacity in resources.items():
        r = reserved.get(name, 0)
        row = existing.pop(name, None) or NodeResource(node=node, name=name)
        row.capacity, row.reserved, row.allocatable = capacity, r, max(0, capacity - r)
        row.save()
    for row in existing.values():
        row.capacity, row.allocatable = 0, 0
        row.save(update_fields=["capacity", "allocatable"])


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


# --- enrollment ------------------------------------------------------------------------------------


def node_enroll(
    *,
    bootstrap_token: str,
    expected_pool: str | None = None,
    expected_node: str | None = None,
    hostname: str = "",
    display_name: str = "",
    addresses: list[str] | None = None,
    agent_version: str,
    labels: dict[str, str] | None = None,
    capability: dict[str, Any],
    attestation: dict[str, str] | None = None,
    request_id: str = "",
    now: datetime | None = None,
    devices: Any = None,
    boot_id: str = "",
) -> tuple[Node, NodeCredential, str]:
    """Enroll a new node: spend a bootstrap token, create a ``pending`` node and its first credential.

    ``capability`` is already canonical (:func:`fleet.capability.parse_capability`). A new
    enrollment always creates a new identity (a fresh UUID generated here, never taken from input).
    Node-declared ``labels`` go to ``node_labels``; the pool's labels and taints become the
    node's platform labels and taints. The owner is the token's owner (the contributor, for
    marketplace pools). A pool with automatic admission starts admission at once.

    A token that names a node creates none: the agent takes that node over, keeping its identity
    (:mod:`fleet.takeover`; ``expected_node``, when sent, must be that node), in a new incarnation.

    Returns ``(node, credential, credential_secret)``. Raises the errors of :func:`bootstrap_token_use`,
    and for a token naming a node 410 ``node_retired`` and 409 ``node_quarantined`` (nothing spent).
    """
    now = now or timezone.now()
    with transaction.atomic():
        token = bootstrap_token_use(
            secret=bootstrap_token, expected_pool=expected_pool, expected_node=expected_node, now=now
        )
        pool = token.pool
        actor = Actor(ActorType.SYSTEM, f"bootstrap-token:{token.prefix}", request_id=request_id)
        if token.node_id is not None:
            node = _locked_node(token.node_id)
            credential, secret = takeover.take_over(
                node=node, token=token, hostname=hostname, display_name=display_name, addresses=addresses or [],
                agent_version=agent_version, labels=labels or {}, capability=capability, attestation=attestation,
                actor=actor, now=now,
            )  # fmt: skip
            _enrollment_devices(node, devices, boot_id, actor, now)
            if node.lifecycle == Lifecycle.PENDING and pool.admission_mode == AdmissionMode.AUTOMATIC:
                _start_admission(node, actor, reason="automatic admission (pool policy)", now=now)
            return node, credential, secret
        node = Node.objects.create(
            pool=pool,
            owner=token.owner,
            hostname=hostname,
            display_name=display_name,
            addresses=addresses or [],
            labels=dict(pool.labels or {}),
            node_labels=labels or {},
            taints=list(pool.taints or []),
            taints_added_at=taint_times.stamp({}, list(pool.taints or []), now),
            declared=capability,
            agent_version=agent_version,
            enrolled_agent_version=agent_version,
            enrolled_at=now,
            bootstrap_token=token,
            attestation=attestation or {},
            lifecycle_changed_at=now,
        )
        credential, secret = issue_credential(node=node, issuer="enrollment", agent_version=agent_version, now=now)
        record_event(
            node,
            event_types.ENROLLED,
            actor,
            to_state=Lifecycle.PENDING,
            reason=f"enrolled with bootstrap token {token.prefix}",
            data={"hostname": hostname, "agent_version": agent_version, "credential": credential.prefix},
        )
        _enrollment_devices(node, devices, boot_id, actor, now)
        if pool.admission_mode == AdmissionMode.AUTOMATIC:
            _start_admission(node, actor, reason="automatic admission (pool policy)", now=now)
    return node, credential, secret


def _enrollment_devices(node: Node, devices: Any, boot_id: str, actor: Actor, now: datetime) -> None:
    """The enrollment's device inventory as rows (unverified until admission; fleet.devices). On a
    node taken over these are the same node's devices: a handover, never an identity conflict."""
    if devices is not None or boot_id:
        parsed, refusals = parse_devices(devices)
        device_inventory.apply_report(
            node=node, devices=parsed, refusals=refusals, boot_id=boot_id, actor=actor, now=now, force=True
        )


# --- admission start ----------------------------------------------------------------------------------


def queue_admission(*, node: Node) -> int:
    """Start a new admission attempt for ``node`` (already moved to ``admitting`` and saved).

    Call inside the transaction of that transition (the maintenance issue's return-to-service does
    too). Increments ``admission_attempt`` and dispatches ``fleet.run_admission`` on commit, so the
    worker never sees the node before the transition is visible. Returns the attempt number.
    """
    Node.objects.filter(pk=node.pk).update(admission_attempt=F("admission_attempt") + 1)
    attempt = Node.objects.filter(pk=node.pk).values_list("admission_attempt", flat=True).get()
    node.admission_attempt = attempt
    node_id = str(node.pk)

    def dispatch():
        # Fails open (nodepool.failsafe): the stalled-admission sweep sends what the broker missed.
        # By name (fleet.admission.run_admission_task's reason): fleet.tasks runs admission.
        failsafe.publish(celery_app.signature("fleet.run_admission"), args=(node_id, attempt))

    transaction.on_commit(dispatch)
    return attempt


def _start_admission(node: Node, actor: Actor, *, reason: str, now: datetime) -> None:
    before = node.lifecycle
    node.start_admission()
    node.lifecycle_reason = reason
    node.lifecycle_changed_at = now
    node.version += 1
    node.save(update_fields=["lifecycle", "lifecycle_reason", "lifecycle_changed_at", "version", "updated_at"])
    post_instructions([node.pk], Instruction.LIFECYCLE)
    record_event(node, event_types.LIFECYCLE, actor, from_state=before, to_state=node.lifecycle, reason=reason)
    queue_admission(node=node)


def _locked_node(node_id) -> Node:
    # The node row alone (of=self): its pool is read for the response, not locked, or every action
    # on a node of the pool would wait for this one, and pool_update (pool, then its nodes) deadlock.
    node = Node.objects.select_for_update(no_key=True, of=("self",)).select_related("pool").filter(pk=node_id).first()
    if node is None:
        raise NotFound("No such node.", NODE_NOT_FOUND)
    return node


def node_admit(*, node_id, expected_version: int, actor: Actor, reason: str = "") -> Node:
    """Operator admission: ``pending → admitting`` and queue the admission checks.

    Raises: 404 ``node_not_found``, 412 ``version_mismatch``, 409 ``transition_not_allowed``.
    """
    with transaction.atomic():
        node = _locked_node(node_id)
        check_version(node.version, expected_version)
        if not can_proceed(node.start_admission):
            raise Conflict(
                f"A {node.lifecycle} node cannot be admitted; only pending nodes can.",
                TRANSITION_NOT_ALLOWED,
                lifecycle=node.lifecycle,
            )
        _start_admission(node, actor, reason=reason or "admitted by an operator", now=timezone.now())
    return node


# --- node credentials -----------------------------------------------------------------------------


def node_credential_rotate(
    *, node: Node, credential: NodeCredential, agent_version: str = "", request_id: str = "", now=None
) -> tuple[NodeCredential, str, datetime]:
    """Rotate the node's credential: a new one, and the old one valid only for a short overlap.

    The overlap (``NODEPOOL["CREDENTIAL_ROTATION_OVERLAP"]`` seconds, 5 min by default) lets
    requests already in flight with the old credential finish. Only the newest credential of the
    lineage may rotate, and at most ``NODEPOOL["CREDENTIAL_ROTATIONS_PER_HOUR"]`` rotations per
    node succeed in any hour (counted from the credential rows, so every web process agrees).

    Returns ``(new_credential, secret, previous_valid_until)``.

    Raises:
        Gone: 410 ``node_retired``.
        Conflict: 409 ``credential_superseded`` (this credential was already rotated; nothing changes).
        Throttled: 429 ``rotation_throttled`` with ``Retry-After``.
    """
    now = now or timezone.now()
    if node.lifecycle == Lifecycle.RETIRED:
        raise Gone("This node is retired.", NODE_RETIRED)
    overlap = timedelta(seconds=conf.get("CREDENTIAL_ROTATION_OVERLAP"))
    with transaction.atomic():
        # The row lock serialises rotations made with the same credential: of two at once, the
        # second sees superseded_by set and gets 409 (only one successor per credential).
        old = NodeCredential.objects.select_for_update().get(pk=credential.pk)
        if is_superseded(old):
            raise Conflict(
                "This credential was already rotated; only the newest credential of a node may rotate.",
                CREDENTIAL_SUPERSEDED,
            )
        _check_rotation_rate(node, now)
        new, secret = issue_credential(
            node=node, issuer="rotation", agent_version=agent_version or node.agent_version, now=now
        )
        old.expires_at = min(old.expires_at, now + overlap)
        old.rotated_at = now
        old.superseded_by = new
        old.save(update_fields=["expires_at", "rotated_at", "superseded_by"])
        record_event(
            node,
            event_types.CREDENTIAL,
            Actor.for_node(node, request_id),
            reason="credential rotated",
            data={"previous": old.prefix, "new": new.prefix, "previous_valid_until": old.expires_at.isoformat()},
        )
    return new, secret, old.expires_at


def _check_rotation_rate(node: Node, now) -> None:
    """429 when the node already rotated ``CREDENTIAL_ROTATIONS_PER_HOUR`` times in the last hour."""
    limit = conf.get("CREDENTIAL_ROTATIONS_PER_HOUR")
    window = timedelta(hours=1)
    recent = list(
        NodeCredential.objects.filter(node=node, issuer="rotation", issued_at__gt=now - window)
        .order_by("issued_at")
        .values_list("issued_at", flat=True)[: max(limit, 1)]
    )
    if len(recent) >= limit:
        wait = max(1, math.ceil((recent[0] + window - now).total_seconds()))
        raise TooManyRequests(
            f"This node rotated its credential {limit} times within an hour; try again in {wait} s.",
            ROTATION_THROTTLED,
            retry_after=wait,
        )


def node_credentials_revoke(*, node_id, expected_version: int, actor: Actor, reason: str = "") -> tuple[Node, int]:
    """Operator: revoke every credential of one node (no other node is touched). Returns ``(node, count)``."""
    with transaction.atomic():
        node = _locked_node(node_id)
        check_version(node.version, expected_version)
        count = revoke_all_credentials(node=node)
        node.version += 1
        node.save(update_fields=["version", "updated_at"])
        record_event(
            node, event_types.CREDENTIAL, actor, reason=reason or "credentials revoked", data={"revoked": count}
        )
    return node, count


def node_credential_issue(
    *, node_id, expected_version: int, actor: Actor, ttl_seconds: int | None = None, reason: str = ""
) -> tuple[Node, NodeCredential, str]:
    """Operator: issue a new credential to a node (after a release from quarantine, or a lost state file).

    Raises: 404, 412, 410 ``node_retired``, 409 ``node_quarantined`` (release it first).
    """
    with transaction.atomic():
        node = _locked_node(node_id)
        check_version(node.version, expected_version)
        if node.lifecycle == Lifecycle.RETIRED:
            raise Gone("This node is retired.", NODE_RETIRED)
        if node.lifecycle == Lifecycle.QUARANTINED:
            raise Conflict("A quarantined node gets no credential; release it first.", NODE_QUARANTINED)
        credential, secret = issue_credential(
            node=node, issuer=f"operator:{actor.name}", agent_version=node.agent_version, ttl_seconds=ttl_seconds
        )
        node.version += 1
        node.save(update_fields=["version", "updated_at"])
        record_event(
            node,
            event_types.CREDENTIAL,
            actor,
            reason=reason or "credential issued by an operator",
            data={"credential": credential.prefix, "expires_at": credential.expires_at.isoformat()},
        )
    return node, credential, secret
