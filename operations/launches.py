"""Asking a pool's provider for machines: the scale decision recorded under the pool's settings lock,
the machines and their single-use bootstrap tokens, the provider's create call after commit
(retried a bounded number of times; a failure leaves nothing half-done), and the extra capacity
others ask for (an upgrade's surge, a preemption's or a repair's replacement).
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from fleet import services as fleet_services
from fleet.events import Actor, record_event
from fleet.models import BootstrapToken, Pool
from nodepool import fsm

from . import capacity, conf, event_types, providers
from .choices import (
    MachineState,
    ProviderKind,
    ScaleDirection,
    ScaleOutcome,
)
from .machines import back_off, remove_failed
from .models import PoolOperations, ProviderMachine, ScaleDecision
from .providers import MachineRequest, ProviderError

logger = logging.getLogger(__name__)


def _decide(pool: Pool, direction: str, outcome: str, count: int, reason: str, actor: Actor, **data) -> ScaleDecision:
    decision = ScaleDecision.objects.create(
        pool=pool, direction=direction, outcome=outcome, count=count, reason=reason, data=data
    )
    record_event(
        None,
        event_types.SCALE,
        actor,
        pool=pool,
        subject_type="scale_decision",
        subject_id=decision.pk,
        to_state=outcome,
        reason=reason,
        data={"direction": direction, "count": count, **data},
    )
    return decision


def _held_back(pool: Pool, direction: str, reason: str, actor: Actor, **data) -> None:
    """Record a held-back decision unless the pool's latest decision says the same."""
    last = ScaleDecision.objects.filter(pool=pool).order_by("-created_at", "-id").first()
    if last is None or last.outcome != ScaleOutcome.BLOCKED or last.reason != reason:
        _decide(pool, direction, ScaleOutcome.BLOCKED, 0, reason, actor, **data)


def _new_machines(ops: PoolOperations, decision: ScaleDecision, count: int, *, pending_since, now) -> list:
    """``count`` machine rows, each with a fresh single-use bootstrap token, and the provider requests."""
    pool = ops.pool
    requests = []
    for _ in range(count):
        name = f"{pool.name[:40]}-{uuid.uuid4().hex[:10]}"
        token, secret = fleet_services.bootstrap_token_create(
            pool=pool,
            expires_at=now + timedelta(seconds=ops.boot_timeout),
            max_uses=1,
            description=f"autoscaler machine {name}",
            now=now,
        )
        ProviderMachine.objects.create(
            pool=pool,
            provider=ops.provider,
            name=name,
            decision=decision,
            bootstrap_token=token,
            requested_at=now,
            pending_since=pending_since,
            template=ops.node_template or {},
        )
        requests.append(
            MachineRequest(
                name=name,
                bootstrap_token=secret,
                template=ops.node_template,
                version=(ops.target or {}).get("version", ""),
            )
        )
    return requests


def request_surge(*, pool_id, count: int, upgrade_id, actor: Actor, now=None) -> int:
    """Ask the provider for ``count`` extra nodes before an upgrade takes nodes out (its
    ``max_surge_nodes``), within ``max_nodes``. Once per upgrade. Returns machines requested."""
    return request_extra(
        pool_id=pool_id,
        count=count,
        why="upgrade surge: {count} node(s) before nodes are taken out",
        key={"upgrade_id": str(upgrade_id)},
        actor=actor,
        now=now,
    )


def request_replacement(*, pool_id, preemption_id, node_id, actor: Actor, now=None) -> int:
    """Replacement capacity for a preempted node, asked at once (not when its evicted work comes
    back as pending requests): one node of the pool's template, or of its ``fallback_pool``'s when
    the pool has no provider or no room. The preempted node does not count against ``max_nodes``:
    it is going away. A pool without autoscaling (no operations settings, or no provider) cannot
    replace; when neither pool can, the preempted pool records why (a held-back decision) and
    nothing is requested. Once per preemption. Returns machines requested (0 or 1)."""
    ops = PoolOperations.objects.select_related("pool", "fallback_pool").filter(pool_id=pool_id).first()
    key = {"preemption_id": preemption_id}
    why = "replacement for a preempted node: {count} node(s) at once"
    got = request_extra(pool_id=pool_id, count=1, why=why, key=key, actor=actor, now=now, leaving=[node_id])
    if got:
        return got
    fallback = ops.fallback_pool if ops is not None else None
    if fallback is not None:
        pool_name = ops.pool.name
        got = request_extra(
            pool_id=fallback.pk,
            count=1,
            why=why + f" (fallback of {pool_name})",
            key=key,
            actor=actor,
            now=now,
        )
        if got:
            return got
    # Neither pool asked its provider. Say why, once, unless a pool already did (e.g. at max_nodes).
    if not ScaleDecision.objects.filter(data__preemption_id=preemption_id).exists():
        pool = ops.pool if ops is not None else Pool.objects.filter(pk=pool_id).first()
        if pool is not None:
            reasons = [f"pool {pool.name}: {_no_replacement(ops)}"]
            if fallback is not None:
                fallback_ops = PoolOperations.objects.filter(pool_id=fallback.pk).first()
                reasons.append(f"fallback pool {fallback.name}: {_no_replacement(fallback_ops)}")
            else:
                reasons.append("no fallback pool")
            _decide(
                pool,
                ScaleDirection.UP,
                ScaleOutcome.BLOCKED,
                0,
                why.format(count=0) + "; held back: " + "; ".join(reasons),
                actor,
                **key,
            )
    return 0


def _no_replacement(ops: PoolOperations | None) -> str:
    if ops is None or ops.provider == ProviderKind.NONE:
        return "no autoscaling (no provider)"
    return "no replacement"


def request_extra(*, pool_id, count: int, why: str, key: dict, actor: Actor, now=None, leaving=()) -> int:
    """``count`` extra nodes from the pool's provider within ``max_nodes`` (``leaving``: node ids
    not counted as members), once per ``key`` (a ``ScaleDecision.data`` member naming the cause).
    The decision is recorded under the pool's settings lock; the provider is called after it
    commits. Returns machines requested."""
    now = now or timezone.now()
    ((name, value),) = key.items()
    with transaction.atomic():
        ops = (
            PoolOperations.objects.select_for_update(of=("self",))
            .select_related("pool")
            .filter(pool_id=pool_id)
            .first()
        )
        if ops is None or ops.provider == ProviderKind.NONE:  # no autoscaling here
            return 0
        if ScaleDecision.objects.filter(pool_id=pool_id, **{f"data__{name}": value}).exists():
            return 0
        members = capacity.member_nodes(ops.pool).exclude(pk__in=list(leaving)).count()
        in_flight = ProviderMachine.objects.filter(
            pool_id=pool_id, state__in=[MachineState.REQUESTED, MachineState.ENROLLED]
        ).count()
        room = (ops.max_nodes - members - in_flight) if ops.max_nodes else 0
        count = max(0, min(count, room))
        reason = why.format(count=count)
        if count == 0:
            _decide(
                ops.pool,
                ScaleDirection.UP,
                ScaleOutcome.BLOCKED,
                0,
                reason + f"; held back: at max_nodes {ops.max_nodes}",
                actor,
                **key,
            )
            return 0
        decision = _decide(ops.pool, ScaleDirection.UP, ScaleOutcome.REQUESTED, count, reason, actor, **key)
        requests = _new_machines(ops, decision, count, pending_since=now, now=now)
    _call_provider(ops, decision, requests, actor)
    return count


def surge_ready(*, pool_id, upgrade_id) -> int:
    """Surge machines of ``upgrade_id`` that are ready now (they add room under max_unavailable_nodes)."""
    return ProviderMachine.objects.filter(
        pool_id=pool_id, state=MachineState.READY, decision__data__upgrade_id=str(upgrade_id)
    ).count()


def _call_provider(ops: PoolOperations, decision: ScaleDecision, requests: list[MachineRequest], actor: Actor) -> None:
    attempts, error = 0, ""
    max_attempts = int(conf.get("PROVIDER_MAX_ATTEMPTS"))
    created: dict[str, dict] = {}
    while attempts < max_attempts:
        attempts += 1
        try:
            created = providers.provider_for(ops).create(requests)
            break
        except ProviderError as exc:
            error = str(exc)
            if attempts < max_attempts:
                time.sleep(min(2.0, 0.2 * 2**attempts))
    now = timezone.now()
    with transaction.atomic():
        if created:
            for name, data in created.items():
                ProviderMachine.objects.filter(name=name).update(provider_data=data or {})
            _finish_decision(
                ops,
                decision,
                actor,
                outcome=ScaleOutcome.SUCCEEDED,
                attempts=attempts,
                now=now,
                reason=f"provider accepted {len(requests)} machine(s)",
            )
            return
        back_off(ops.pool_id, now=now)
        machines = ProviderMachine.objects.filter(decision=decision)
        BootstrapToken.objects.filter(pk__in=machines.values("bootstrap_token_id"), revoked_at__isnull=True).update(
            revoked_at=now
        )
        fsm.move(machines, "fail", error=error[:2000], deleted_at=now)
        _finish_decision(
            ops,
            decision,
            actor,
            outcome=ScaleOutcome.FAILED,
            attempts=attempts,
            now=now,
            reason=f"provider failed after {attempts} attempt(s): {error}",
            error=error,
        )
    # A machine the provider started before it failed may have enrolled, and a pass linked its
    # node (enrolled, even ready), before the "fail" above, which moves requested machines only.
    # Left so, it held a place under max_nodes until its boot timeout while the delete below
    # stopped it: it is failed as well, its node retired, and the autoscaler replaces it.
    followed = ProviderMachine.objects.filter(decision=decision, state__in=[MachineState.ENROLLED, MachineState.READY])
    removed = set()
    for machine in followed:
        remove_failed(machine, ops, actor, now=now, error=f"the provider's create failed: {error}")
        removed.add(machine.name)
    for request in requests:  # best effort: the provider may have created some before failing
        if request.name in removed:  # asked to delete by its removal
            continue
        try:
            providers.provider_for(ops).delete(request.name, {})
        except ProviderError:
            logger.warning("could not ask the provider to delete %s after a failed create", request.name)


def _finish_decision(
    ops: PoolOperations,
    decision: ScaleDecision,
    actor: Actor,
    *,
    outcome: str,
    attempts: int,
    now,
    reason: str,
    error: str = "",
) -> None:
    """A requested decision's outcome once the provider answered (or ``attempts`` ran out), and its event."""
    ScaleDecision.objects.filter(pk=decision.pk).update(
        outcome=outcome, attempts=attempts, error=error[:2000], finished_at=now
    )
    record_event(
        None,
        event_types.SCALE,
        actor,
        pool=ops.pool_id,
        subject_type="scale_decision",
        subject_id=decision.pk,
        from_state=ScaleOutcome.REQUESTED,
        to_state=outcome,
        reason=reason,
        data={"attempts": attempts},
    )
