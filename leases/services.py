"""Lease services: grant (place + reserve), lease requests, shapes.

The fenced writes (renew, release, job events, checkpoints, fencing validation) are
:mod:`leases.fencing`; ending a lease is :mod:`leases.lifecycle`; what heartbeats and maintenance
call (:func:`~leases.reconcile.reconcile_heartbeat`, :func:`~leases.reconcile.lose_node_leases`,
:func:`~leases.reconcile.revoke_node_leases`, :func:`~leases.reconcile.revoke_lease`,
:func:`~leases.reconcile.simulate_placement`) is :mod:`leases.reconcile`; the queue kick is
:mod:`leases.kick`. Import them from there (nothing is re-exported here: issue 28, step 4).

Every write follows the house pattern: ``atomic()`` → compare-and-swap on the lease row (or a
conditional UPDATE on capacity) → event row in the same transaction. Capacity moves only in the
transaction that changes a lease's liveness, so ``NodeResource.allocated`` is always the sum of the
node's live leases (checked by :func:`leases.sweeps.check_consistency`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from typing import Any, NamedTuple

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Max
from django.utils import timezone

from fleet.choices import Lifecycle, Liveness
from fleet.errors import UNKNOWN_POOL
from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import Node, NodeResource, Pool
from fleet.selectors import SCHEDULABLE_HEALTH
from humanunits import quantity
from nodepool import fsm
from nodepool.api.errors import CONCURRENT_MODIFICATION
from nodepool.api.permissions import is_operator
from nodepool.api.problems import Conflict, NotFound, Unprocessable
from nodepool.db import fetch_rows, insert_row, prepared_cursor
from nodepool.structured_logs import bind

from . import device_requests, event_types, impossible, placement, requeue
from . import devices as lease_devices
from . import metrics as lease_metrics
from .choices import LIVE_LEASE_STATES, LeaseState
from .errors import (
    EMPTY_REQUEST,
    IDEMPOTENCY_KEY_REUSED,
    IMPOSSIBLE_REQUEST,
    LEASE_REQUEST_NOT_FOUND,
    LEASE_REQUEST_NOT_PENDING,
    UNKNOWN_SHAPE,
    UNSCHEDULABLE,
    WORKLOAD_HAS_LIVE_LEASE,
)
from .models import FencingSequence, Lease, LeaseRequest, Shape
from .selectors import visible
from .spec import (
    WORKLOAD_ID,
    PlacementSpec,
    bad,
    device_requests_from_wire,
    parse_spec,
    request_fingerprint,
    resources_from_wire,
    with_device_counts,
)

logger = logging.getLogger(__name__)
PLACEMENT_ROUNDS = 2  # re-run placement once when every candidate was taken by racing requests


class _LostRace(Exception):
    """Raised inside the reservation transaction to roll it back: the node filled up meanwhile."""


# --- resolving a request -------------------------------------------------------------------------
def resolve_pool(name: str) -> Pool:
    """The pool named ``name``, read by a prepared statement (every grant reads it).

    Raises:
        Problem 400 ``unknown_pool``: no pool has that name.
    """
    pools = fetch_rows(Pool, "name", name, limit=1)
    if not pools:
        raise bad("pool", f"no pool named {name!r}", UNKNOWN_POOL)
    return pools[0]


def resolve_shape(spec: PlacementSpec) -> tuple[PlacementSpec, Shape | None]:
    """Fill ``spec.resources`` (and features) from the named shape: its latest version unless
    ``shape_version`` is given. Raises 400 ``unknown_shape``."""
    if not spec.shape:
        return spec, None
    shapes = Shape.objects.filter(name=spec.shape)
    if spec.shape_version:
        shapes = shapes.filter(version=spec.shape_version)
    shape = shapes.order_by("-version").first()
    if shape is None:
        version = f" v{spec.shape_version}" if spec.shape_version else ""
        raise bad("shape", f"no shape named {spec.shape!r}{version}", UNKNOWN_SHAPE)
    features = {**(shape.features or {}), **spec.features}
    explicit = tuple(r for r in spec.devices if not r.implicit) or device_requests_from_wire(shape.devices or None)
    resources = with_device_counts(dict(shape.resources), explicit)
    devices = device_requests.combined(explicit, resources)
    return dataclasses.replace(spec, resources=resources, features=features, devices=devices), shape


# --- grant ---------------------------------------------------------------------------------------
def _next_fencing_token(workload_id: str) -> int:
    """Bump and return the workload's fencing token in one statement (an upsert that locks the
    row until commit, so grants of one workload are serialised and tokens strictly increase)."""
    table = connection.ops.quote_name(FencingSequence._meta.db_table)
    with prepared_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (workload_id, last_token) VALUES (%s, 1) "  # noqa: S608 (the table name comes from the model, not input)
            f"ON CONFLICT (workload_id) DO UPDATE SET last_token = {table}.last_token + 1 RETURNING last_token",
            [workload_id],
        )
        return cursor.fetchone()[0]


class _Held(NamedTuple):
    instructions: int  # the pending-instruction bits (fleet.instructions)
    incarnation: int


def _hold_schedulable_node(node_id) -> _Held | None:
    """Re-check, inside the grant's transaction, that the node may still take work, and hold it.

    Returns the node's pending-instruction bits and incarnation as they are under the hold when
    it is schedulable, None when it no longer is. The lease takes that incarnation, not the one
    the candidate search read: a restart reported in between must not leave the new lease on the
    old incarnation (lost at once).

    The candidate was read before this transaction; a cordon, drain or quarantine may have
    committed since. On PostgreSQL ``FOR SHARE`` also blocks one that has not committed yet until
    this grant commits, so a quarantine's revocation always sees the new lease (the operator
    actions lock the node ``FOR NO KEY UPDATE``, maintenance.services.lock_node, which conflicts
    with ``FOR SHARE``); grants on the same node still share the lock. SQLite runs one write
    transaction at a time, so the plain read is enough there.

    The same hold makes the returned bits stable until COMMIT: a status report clears them with an
    UPDATE of this row, which waits for the lock (PostgreSQL) or for this write transaction
    (SQLite), and reads the node's leases only afterwards.
    """
    table = connection.ops.quote_name(Node._meta.db_table)
    lock = " FOR SHARE" if connection.vendor == "postgresql" else ""
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT lifecycle, liveness, ready, health, cordoned, status_report_overdue, instructions, "  # noqa: S608
            f"incarnation FROM {table} WHERE id = %s{lock}",
            [Node._meta.pk.get_db_prep_value(node_id, connection)],
        )
        row = cursor.fetchone()
    schedulable = bool(
        row
        and row[0] == Lifecycle.READY
        and row[1] == Liveness.ALIVE
        and row[2]
        and row[3] in SCHEDULABLE_HEALTH
        and not row[4]
        and not row[5]
    )
    return _Held(row[6], row[7]) if schedulable else None


def _take_capacity(node_id, resources: dict[str, int]) -> int:
    """``allocated += amount`` on the node's row of each resource in ``resources`` (name → amount,
    canonical units) where it stays within ``allocatable``; returns the number of rows changed.

    One statement for every resource: the row count proves all of them fitted (the caller rolls
    back otherwise). Plain SQL like the hold and the fencing upsert above (all three prepared on
    PostgreSQL, ``nodepool.db.prepared_cursor``): the ORM's CASE expression cost more to build
    than the statement costs to run.
    """
    table = connection.ops.quote_name(NodeResource._meta.db_table)
    amount = "CASE name " + " ".join("WHEN %s THEN %s" for _ in resources) + " END"
    pairs = [value for item in resources.items() for value in item]
    names = ", ".join(["%s"] * len(resources))
    with prepared_cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET allocated = allocated + {amount} "  # noqa: S608 (names from the model; values bound)
            f"WHERE node_id = %s AND name IN ({names}) AND allocated + {amount} <= allocatable",
            [*pairs, Node._meta.pk.get_db_prep_value(node_id, connection), *resources, *pairs],
        )
        return cursor.rowcount


def _reserve(
    *,
    pool: Pool,
    spec: PlacementSpec,
    shape,
    candidate,
    client,
    idempotency_key: str,
    request_hash: str,
    data: dict,
    actor: Actor,
    now,
    lease_request: LeaseRequest | None = None,
    examined: int = 0,
) -> Lease:
    """One transaction: fencing token, a conditional UPDATE per resource, the lease, the event.

    ``UPDATE … SET allocated = allocated + x WHERE allocated + x <= allocatable`` is the whole
    race guard: PostgreSQL re-evaluates the WHERE on the newest row version after waiting for a
    competing writer, SQLite runs one writer at a time, so a slot is never given twice.

    Raises:
        _LostRace: a resource no longer fits on this node (the caller tries the next candidate),
            or ``lease_request`` is no longer pending (the caller stops).
        IntegrityError: the workload got a live lease meanwhile (the partial unique index):
            lease_create answers 409 ``workload_has_live_lease``, the queue pass waits for it.
    """
    node = candidate.node
    decision = {
        "policy_version": placement.POLICY_VERSION,
        "policy": pool.scheduling_policy,
        "score": candidate.score["score"],
        "score_parts": candidate.score["parts"],
        "nodes_examined": examined,
        "reasons": _why(pool, spec, candidate),
    }
    with transaction.atomic():
        held = _hold_schedulable_node(node.pk)
        if held is None:
            raise _LostRace("node")
        # The workload's fencing row first, as every grant takes it (a direct grant then cancels
        # the workload's requeued request: request row second, never the other way round).
        token = _next_fencing_token(spec.workload_id)
        # Then a queued request is claimed: a second queue pass placing the same request waited on
        # the fencing row for the first to commit, and now finds it placed and stands down.
        if lease_request is not None and not fsm.move(
            LeaseRequest.objects.filter(pk=lease_request.pk),
            "place",
            placed_at=now,
            version=F("version") + 1,
            attempts=F("attempts") + 1,
            last_attempt_at=now,  # the attempt that placed it counts too
        ):
            raise _LostRace("lease_request")  # another pass placed it, or its client cancelled it
        # The lease row next: the partial unique index refuses a second live lease of the workload
        # (IntegrityError, answered as 409 by lease_create) before any capacity is touched.
        lease = Lease(
            workload_id=spec.workload_id,
            fencing_token=token,
            node_id=node.pk,
            node_incarnation=held.incarnation,
            pool=pool,
            resources=spec.resources,
            shape=shape,
            shape_version=shape.version if shape else None,
            group=spec.spread_group,
            priority=spec.priority,
            command=list(spec.command),
            spec=data,
            decision=decision,
            ttl_seconds=spec.ttl_seconds,
            expires_at=now + timedelta(seconds=spec.ttl_seconds),
            granted_at=now,
            client=client,
            idempotency_key=idempotency_key if lease_request is None else "",
            request_hash=request_hash,
        )
        # Specific devices before the lease row (whose pk they name; the foreign key is checked at
        # COMMIT): the partial unique index on live LeaseDevice rows is the guard, and a racing
        # grant of the same device waits on it here and then loses (leases.devices). It is taken
        # before the capacity rows, like every grant, so the lock order stays one.
        if spec.devices:
            try:
                lease.devices = lease_devices.claim(
                    lease=lease, node_id=node.pk, requests=spec.devices, tolerates=_device_tolerance(spec)
                )
            except lease_devices.NoDevices as exc:
                raise _LostRace("devices") from exc
        insert_row(lease)  # Lease.objects.create, prepared: nothing listens to a lease's save
        if lease_request is not None:
            LeaseRequest.objects.filter(pk=lease_request.pk).update(lease=lease)
        # A requeue names an earlier lease of the workload, which took a token from the fencing
        # sequence (never deleted): at token 1 there is none, and nothing to supersede.
        if token > 1 or lease_request is not None:
            requeue.on_granted(lease, lease_request, actor=actor)
        record_event(
            node.pk,
            event_types.LEASE,
            actor,
            to_state=LeaseState.GRANTED,
            reason=f"lease granted to {spec.workload_id}",
            data={"lease_id": str(lease.pk), "workload_id": spec.workload_id, "fencing_token": token},
            lease_id=lease.pk,
            workload_id=spec.workload_id,
        )
        # Capacity last: the node's rows stay locked only from here to COMMIT, which is what
        # bounds grants per second on one busy node.
        if _take_capacity(node.pk, spec.resources) != len(spec.resources):
            raise _LostRace("capacity")

        # Once committed, the node's next renewal says a lease waits (fleet.instructions), unless
        # the bit is up already and held so by _hold_schedulable_node: one UPDATE and COMMIT less.
        if not held.instructions & Instruction.LEASES:
            post_instructions([node.pk], Instruction.LEASES)
    return lease


def _free(inventory: tuple[int, int]) -> int:
    """Free amount from an ``(allocatable, allocated)`` pair."""
    return inventory[0] - inventory[1]


def _device_tolerance(spec: PlacementSpec):
    """Whether the request's tolerations tolerate one device taint (Kubernetes semantics: an
    empty-key ``Exists`` toleration tolerates every device taint too)."""
    if not spec.tolerations:
        return None
    return lambda taint: any(t.tolerates(taint) for t in spec.tolerations)


def _why(pool: Pool, spec: PlacementSpec, candidate) -> list[str]:
    reasons = [
        "fits: "
        + ", ".join(
            f"{n} {quantity(n, a)} of {quantity(n, _free(candidate.inventory.get(n, (0, 0))))} free"
            for n, a in sorted(spec.resources.items())
        )
    ]
    policy = "most allocated (binpack)" if pool.scheduling_policy == "binpack" else "least allocated (spread)"
    reasons.append(f"pool policy {policy}: resources score {candidate.score['parts']['resources']}")
    for part in ("spread", "affinity", "taints"):
        if part in candidate.score["parts"]:
            reasons.append(f"{part} score {candidate.score['parts'][part]}")
    return reasons


def place(
    *,
    pool: Pool,
    spec: PlacementSpec,
    shape,
    client,
    idempotency_key: str,
    request_hash: str,
    data: dict,
    actor: Actor,
    now,
    lease_request: LeaseRequest | None = None,
) -> tuple[Lease | None, dict | None]:
    """Filter, score and reserve.

    Returns ``(lease, None)``, or ``(None, explanation)`` when nothing fits (after trying every
    candidate): ``explanation`` is :func:`placement.diagnose`'s answer when the search already ran
    the census, else None (the caller explains if it must).
    """
    started = time.perf_counter()
    lease, explanation = _place(
        pool=pool,
        spec=spec,
        shape=shape,
        client=client,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        data=data,
        actor=actor,
        now=now,
        lease_request=lease_request,
    )
    if lease is not None:
        bind(lease_id=lease.pk, workload_id=lease.workload_id, pool=pool.name, node_id=lease.node_id)
        logger.info("lease_granted", extra={"fencing_token": lease.fencing_token})
        took = time.perf_counter() - started
        waited = (now - lease_request.created_at).total_seconds() if lease_request is not None else took
        lease_metrics.lease_granted(pool=pool.name, grant_seconds=took, pending_seconds=waited)
    return lease, explanation


def _place(*, pool, spec, shape, client, idempotency_key, request_hash, data, actor, now, lease_request):
    for _ in range(PLACEMENT_ROUNDS):
        candidates, examined, explanation = placement.find_candidates(pool, spec, now=now)
        if not candidates:
            return None, explanation
        for candidate in candidates:
            try:
                return _reserve(
                    pool=pool,
                    spec=spec,
                    shape=shape,
                    candidate=candidate,
                    client=client,
                    idempotency_key=idempotency_key,
                    request_hash=request_hash,
                    data=data,
                    actor=actor,
                    now=now,
                    lease_request=lease_request,
                    examined=examined,
                ), None
            except _LostRace as exc:
                if str(exc) == "lease_request":
                    return None, None
                continue
    return None, None


def _replay(client, idempotency_key: str, request_hash: str) -> tuple[Any, int] | None:
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


def lease_create(*, data: Any, client, actor: Actor, idempotency_key: str = "", now=None) -> tuple[Any, int]:
    """``POST /node-leases``: place and reserve, or explain, or queue.

    Returns ``(Lease, 201)``, ``(LeaseRequest, 202)`` when queued, or the earlier result with 200
    when ``idempotency_key`` repeats a request.

    Raises:
        Problem 400 (bad input, unknown pool or shape), Unprocessable 422 (key reused with another
        body; a queued request no node of the pool could ever hold), Conflict 409 (``unschedulable``
        with ``reasons``/``nodes_considered``/``fragmented``/``cause``; ``workload_has_live_lease``).
    """
    now = now or timezone.now()
    if idempotency_key and len(idempotency_key) > 200:
        raise bad("Idempotency-Key", "at most 200 characters")
    request_hash = request_fingerprint(data) if idempotency_key else ""
    if idempotency_key:
        replay = _replay(client, idempotency_key, request_hash)
        if replay:
            return replay
    try:
        return _create(
            data=data, client=client, actor=actor, idempotency_key=idempotency_key, request_hash=request_hash, now=now
        )
    except Conflict as exc:
        # A concurrent retry under the same key won the race: answer with its lease.
        replay = _replay(client, idempotency_key, request_hash) if idempotency_key else None
        if replay and exc.get_codes() == "workload_has_live_lease":
            return replay
        raise


def _create(*, data, client, actor, idempotency_key: str, request_hash: str, now) -> tuple[Any, int]:
    spec = parse_spec(data)
    pool = resolve_pool(spec.pool)
    spec, shape = resolve_shape(spec)
    try:
        lease, explanation = place(
            pool=pool,
            spec=spec,
            shape=shape,
            client=client,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            data=data,
            actor=actor,
            now=now,
        )
    except IntegrityError:
        # A concurrent request with the same key (or the same workload) committed first.
        replay = _replay(client, idempotency_key, request_hash) if idempotency_key else None
        if replay:
            return replay
        _refuse_second_live_lease(spec.workload_id, client)
        raise Conflict("A concurrent request for this workload won; retry.", CONCURRENT_MODIFICATION) from None
    if lease is not None:
        return lease, 201
    # Checked here rather than up front: the partial unique index already refuses a second live
    # lease when a node fits, so only the nothing-fits answer needs to look.
    _refuse_second_live_lease(spec.workload_id, client)
    explanation = explanation or placement.diagnose(pool, spec, now=now)
    lease_metrics.placement_failed(pool=pool.name, reasons=explanation["reasons"])
    if not spec.queue:
        raise Conflict(
            explanation["message"],
            UNSCHEDULABLE,
            reasons=explanation["reasons"],
            nodes_considered=explanation["nodes_considered"],
            fragmented=explanation["fragmented"],
            cause=explanation["cause"],
            pending_admission=explanation["pending_admission"],
            too_large=explanation.get("too_large"),
        )
    _refuse_impossible(pool, explanation)
    try:
        request = LeaseRequest.objects.create(
            workload_id=spec.workload_id,
            pool=pool,
            spec=data,
            priority=spec.priority,
            reasons=explanation["reasons"],
            message=explanation["message"],
            client=client,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            created_at=now,  # the same instant as its first attempt
            last_attempt_at=now,
            attempts=1,
        )
    except IntegrityError:
        replay = _replay(client, idempotency_key, request_hash)
        if replay:
            return replay
        raise
    return request, 202


def _refuse_second_live_lease(workload_id: str, user) -> None:
    """409 ``workload_has_live_lease`` when the workload already holds a live lease.

    Workload ids are one namespace across clients, so the live lease may be another client's: only
    its own client and operators are told which lease it is (``lease_id``); anyone else gets the
    same code with a message that names no lease (another tenant's object is never named).
    """
    live = Lease.objects.filter(workload_id=workload_id, state__in=LIVE_LEASE_STATES).first()
    if live is None:
        return
    if is_operator(user) or live.client_id == getattr(user, "pk", None):
        raise Conflict(
            f"Workload {workload_id!r} already holds live lease {live.pk}; release it first.",
            WORKLOAD_HAS_LIVE_LEASE,
            lease_id=str(live.pk),
        )
    raise Conflict(
        f"Workload id {workload_id!r} is in use; choose another.",
        WORKLOAD_HAS_LIVE_LEASE,
    )


def _refuse_impossible(pool: Pool, explanation: dict) -> None:
    """422 ``impossible_request``: a queued request must be placeable some day, so it is refused
    when no node of the pool (nor node template it can grow) could ever hold it
    (``cause: "too_large"``, :mod:`leases.impossible`); the body carries the same ``too_large``
    object as the synchronous 409."""
    too_large = explanation.get("too_large")
    if not too_large:
        return
    exceeds = too_large["exceeds"]
    message = impossible.TooLarge(pool=pool.name, **too_large).message
    raise Unprocessable(
        f"{message[0].upper()}{message[1:]}: this request could never be placed, so it is not queued.",
        IMPOSSIBLE_REQUEST,
        field=f"resources.{exceeds[0]}" if exceeds else "resources",
        cause=explanation["cause"],
        too_large=too_large,
    )


# --- shapes --------------------------------------------------------------------------------------
def shape_create(
    *, name: str, resources: Any, features: Any = None, description: str | None = "", actor: Actor, devices: Any = None
) -> Shape:
    """A new version of shape ``name`` (v1 when new). Resources take Kubernetes quantities;
    ``devices`` are device requests (leases.device_requests), whose counts join the resources."""
    if not isinstance(name, str) or not WORKLOAD_ID.match(name) or len(name) > 63:
        raise bad("name", "required: a slug of at most 63 characters")
    if description is not None and not isinstance(description, str):
        raise bad("description", "must be a string")
    canonical = resources_from_wire(resources) if resources is not None or not devices else {}
    explicit = device_requests_from_wire(devices)
    canonical = with_device_counts(canonical, explicit)
    if not canonical:
        raise bad("resources", "a shape needs at least one resource", EMPTY_REQUEST)
    if features is not None and not isinstance(features, dict):
        raise bad("features", "must be an object")
    for _ in range(3):  # two operators publishing at once: the unique (name, version) decides
        try:
            with transaction.atomic():
                latest = Shape.objects.filter(name=name).aggregate(v=Max("version"))["v"] or 0
                return Shape.objects.create(
                    name=name,
                    version=latest + 1,
                    resources=canonical,
                    features=features or {},
                    devices=[r.wire() for r in explicit],
                    description=description or "",
                )
        except IntegrityError:
            continue
    raise Conflict("Another version of this shape was published at the same time; retry.", CONCURRENT_MODIFICATION)


def lease_request_cancel(*, request_id, user, actor: Actor) -> LeaseRequest:
    request = visible(LeaseRequest.objects.all(), user).filter(pk=request_id).first()
    if request is None:
        raise NotFound("No such lease request.", LEASE_REQUEST_NOT_FOUND)
    if not fsm.move(LeaseRequest.objects.filter(pk=request.pk), "cancel", version=F("version") + 1):
        raise Conflict(f"The lease request is {request.state}, not pending.", LEASE_REQUEST_NOT_PENDING)
    request.refresh_from_db()
    return request
