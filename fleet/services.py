"""Fleet services (writes): enrollment, node credentials, admission start.

Each service runs ``atomic()`` → lock or compare-and-swap → check version / ``can_proceed`` →
change → ``save(update_fields=...)`` → :func:`fleet.events.record_event`, and raises
:class:`nodepool.api.problems.Problem` subclasses with stable codes. Pools are written by
:mod:`fleet.pools`, bootstrap tokens by :mod:`fleet.bootstrap_tokens` (both re-exported here for
their callers); admission checks and benchmarks live in :mod:`fleet.admission`.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django_fsm import can_proceed

from nodepool import failsafe
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, Gone, NotFound, TooManyRequests
from nodepool.api.versioning import check_version
from nodepool.celery import app as celery_app

from . import conf, event_types, takeover
from . import devices as device_inventory
from . import taints as taint_times
from .bootstrap_tokens import (  # noqa: F401  (re-exported for callers: moved there, issue 28 step 8)
    bootstrap_token_create,
    bootstrap_token_revoke,
    bootstrap_token_use,
    bootstrap_token_validate,
)
from .choices import ActorType, AdmissionMode, Lifecycle
from .credentials import is_superseded, issue_credential, revoke_all_credentials
from .devices import parse_devices
from .errors import (
    CREDENTIAL_SUPERSEDED,
    NODE_NOT_FOUND,
    NODE_QUARANTINED,
    NODE_RETIRED,
    ROTATION_THROTTLED,
)
from .events import Actor, record_event
from .instructions import Instruction, post_instructions
from .models import Node, NodeCredential
from .pools import (  # noqa: F401  (re-exported for callers: moved there, issue 28 step 8)
    lock_members,
    node_inventory_set,
    node_resources_recompute,
    nodes_apply_pool_labels,
    pool_create,
    pool_delete,
    pool_update,
)

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
