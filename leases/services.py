"""Lease services: lease creation (place + reserve, or explain, or queue), lease requests, shapes.

The grant itself (placement and the reservation transaction) is :mod:`leases.grant`; idempotency
keys are :mod:`leases.idempotency`. The fenced writes (renew, release, job events, checkpoints,
fencing validation) are :mod:`leases.fencing`; ending a lease is :mod:`leases.lifecycle`; what
heartbeats and maintenance call (:func:`~leases.reconcile.reconcile_heartbeat`,
:func:`~leases.reconcile.lose_node_leases`, :func:`~leases.reconcile.revoke_node_leases`,
:func:`~leases.reconcile.revoke_lease`, :func:`~leases.reconcile.simulate_placement`) is
:mod:`leases.reconcile`; the queue kick is :mod:`leases.kick`. Import them from there (nothing is
re-exported here: issue 28, step 4).

Every write follows the house pattern: ``atomic()`` → compare-and-swap on the lease row (or a
conditional UPDATE on capacity) → event row in the same transaction. Capacity moves only in the
transaction that changes a lease's liveness, so ``NodeResource.allocated`` is always the sum of the
node's live leases (checked by :func:`leases.sweeps.check_consistency`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Max
from django.utils import timezone

from fleet.errors import UNKNOWN_POOL
from fleet.events import Actor
from fleet.models import Pool
from nodepool import fsm
from nodepool.api.errors import CONCURRENT_MODIFICATION
from nodepool.api.permissions import is_operator
from nodepool.api.problems import Conflict, NotFound, Unprocessable
from nodepool.db import fetch_rows

from . import device_requests, idempotency, impossible, placement
from . import metrics as lease_metrics
from .choices import LIVE_LEASE_STATES
from .errors import (
    EMPTY_REQUEST,
    IMPOSSIBLE_REQUEST,
    LEASE_REQUEST_NOT_FOUND,
    LEASE_REQUEST_NOT_PENDING,
    UNKNOWN_SHAPE,
    UNSCHEDULABLE,
    WORKLOAD_HAS_LIVE_LEASE,
)
from .grant import place
from .models import Lease, LeaseRequest, Shape
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
        replay = idempotency.replay(client, idempotency_key, request_hash)
        if replay:
            return replay
    try:
        return _create(
            data=data, client=client, actor=actor, idempotency_key=idempotency_key, request_hash=request_hash, now=now
        )
    except Conflict as exc:
        # A concurrent retry under the same key won the race: answer with its lease.
        replay = idempotency.replay(client, idempotency_key, request_hash) if idempotency_key else None
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
        replay = idempotency.replay(client, idempotency_key, request_hash) if idempotency_key else None
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
        replay = idempotency.replay(client, idempotency_key, request_hash)
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
    if not isinstance(name, str) or not WORKLOAD_ID.fullmatch(name) or len(name) > 63:
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
