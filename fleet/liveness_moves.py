"""How the liveness sweep moves nodes (fleet.liveness_sweep decides when and which): set-based
compare-and-swap statements (fleet.sql) with one ``liveness`` event per node moved.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import connection

from . import event_types, sql
from .choices import Liveness
from .events import Actor, event_row
from .models import NodeEvent


def as_uuid(value) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def move(
    *,
    pool_id: int,
    from_state: str,
    to_state: str,
    now: datetime,
    cutoff: datetime | None,
    next_offset: float | None,
    reference: datetime | None,
    ids: list | None,
    actor: Actor,
    reason: str,
    keep_deadline: bool = False,
) -> list[uuid.UUID]:
    """Move due nodes of one pool from ``from_state`` to ``to_state`` in one statement.

    The WHERE clause is the compare-and-swap: ``liveness = from_state`` and the deadline still due,
    so a concurrent sweep or a heartbeat that got there first leaves the row out. On PostgreSQL a
    row another transaction holds (a heartbeat, a drain, an upgrade tick) is skipped, not waited
    for (``FOR NO KEY UPDATE SKIP LOCKED``): the sweep never waits on a node row, so it can never
    deadlock with a transaction that locks several nodes in another order; a skipped node stays
    due and the next run moves it. Returns the ids
    this call moved; their events are written in the same transaction (on PostgreSQL in the same
    statement, a data-modifying CTE, so 100,000 transitions cost one round trip).

    ``next_offset`` sets the next deadline (seconds after the last heartbeat, or after the recovery);
    None clears it (``lost`` is final until a heartbeat). ``keep_deadline`` leaves the passed
    deadline as it is, so the row stays due and is looked at again by the next sweep.
    """
    if ids is not None and not ids:
        return []
    update = sql.liveness_move(
        pool_id=pool_id, from_state=from_state, to_state=to_state, now=now, cutoff=cutoff, next_offset=next_offset,
        reference=reference, ids=ids, keep_deadline=keep_deadline,
    )  # fmt: skip
    template = event(pool_id, from_state=from_state, to_state=to_state, reason=reason, actor=actor, now=now)
    with connection.cursor() as cursor:
        if sql.is_postgresql():
            cursor.execute(*sql.with_events(update, template))
            return [as_uuid(row[0]) for row in cursor.fetchall()]
        cursor.execute(*update)
        moved = [as_uuid(row[0]) for row in cursor.fetchall()]
        # The events with the sweep's time (the template's), 500 nodes a statement as the ORM's batches were.
        for start in range(0, len(moved), 500):
            cursor.execute(*sql.node_events(moved[start : start + 500], template))
    return moved


def event(pool_id, *, actor: Actor, now: datetime, **fields) -> NodeEvent:
    """The liveness event a statement writes for each node it moves (node and pool from the row)."""
    template = event_row(None, event_types.LIVENESS, actor, pool=pool_id, **fields)
    template.created_at = now
    return template


@dataclass(frozen=True)
class Degrade:
    """One pool's transitions short of ``lost``, for :func:`degrade`.

    ``unreachable_cutoff``: an ``alive`` or ``stale`` node whose last heartbeat is at or before it
    becomes ``unreachable`` (its next deadline: ``max(last heartbeat, since) + lost_after``
    seconds); None when no due node of the pool can. ``to_stale``: every other due ``alive`` node
    becomes ``stale`` and keeps its passed deadline: ``stale`` lasts one grace at most, and not
    writing the indexed column keeps a mass transition from rewriting every index of every row
    (the unreachable transition selects stale rows by their last heartbeat anyway).
    """

    pool_id: int
    unreachable_cutoff: datetime | None
    to_stale: bool
    lost_after: float
    since: datetime | None
    unreachable_reason: str
    stale_reason: str


def degrade(plans: list[Degrade], *, now: datetime, actor: Actor) -> dict[int, dict[str, int]]:
    """Move the due nodes of every pool in ``plans`` to ``unreachable`` or ``stale``, with one
    ``liveness`` event each; returns ``{pool pk: {"alive->stale": n, ...}}``.

    On PostgreSQL this is **one statement** whatever the number of pools: the due nodes are read
    once through the deadline index ``node_liveness_due`` (joined to the plans, one row per pool),
    locked ``FOR NO KEY UPDATE SKIP LOCKED`` (a row another transaction holds is skipped, not
    waited for: it stays due and the next run moves it), moved, and their events inserted, in one
    data-modifying CTE that returns only the counts. The lock's recheck of the WHERE clause on the
    row's newest version is the compare-and-swap: a heartbeat or another sweep that got there first
    leaves the row out, so a node moves once with one event. On SQLite (one writer at a time) it is
    :func:`move` per pool and transition. The caller owns the transaction.
    """
    if not plans:
        return {}
    counts: dict[int, dict[str, int]] = {}
    if not sql.is_postgresql():
        for plan in plans:
            moves = []
            if plan.unreachable_cutoff is not None:
                moves += [
                    (from_state, Liveness.UNREACHABLE, plan.unreachable_cutoff, plan.lost_after,
                     plan.unreachable_reason, False)
                    for from_state in (Liveness.ALIVE, Liveness.STALE)
                ]  # fmt: skip
            if plan.to_stale:
                moves.append((Liveness.ALIVE, Liveness.STALE, None, None, plan.stale_reason, True))
            for from_state, to_state, cutoff, offset, reason, keep in moves:
                moved = move(
                    pool_id=plan.pool_id, from_state=from_state, to_state=to_state, now=now, cutoff=cutoff,
                    next_offset=offset, reference=plan.since, ids=None, actor=actor, reason=reason,
                    keep_deadline=keep,
                )  # fmt: skip
                if moved:
                    key = f"{from_state}->{to_state}"
                    counts.setdefault(plan.pool_id, {})[key] = counts.get(plan.pool_id, {}).get(key, 0) + len(moved)
        return counts
    statement = sql.liveness_degrade(plans, now=now, template=event(None, actor=actor, now=now))
    with connection.cursor() as cursor:
        cursor.execute(*statement)
        for pool_id, from_state, to_state, count in cursor.fetchall():
            counts.setdefault(pool_id, {})[f"{from_state}->{to_state}"] = count
    return counts
