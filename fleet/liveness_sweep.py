"""The liveness sweep: degrades silent nodes, set-based, from the deadlines renewals and status reports set.

``unknown`` (never heard) → ``alive`` → ``stale`` (missed about two intervals) → ``unreachable``
(past the pool's grace) → ``lost`` (past the loss threshold: the node's leases are declared lost).
A renewal or status report brings a node back to ``alive``; this module degrades it, with the
timings of fleet.liveness.

:func:`sweep_liveness`, the periodic set-based sweep, selects due rows through
``Node.next_liveness_check_at`` and its partial index ``node_liveness_due`` (the deadline of
the node's next degradation, healthchecks' ``alert_after``), and moves them with compare-and-swap
UPDATEs (``WHERE liveness = <from>``, rechecked on the locked row), so two sweeps at once, or a
sweep racing a heartbeat, can never both move the same node: one event per node per
transition, one ``nodes_lost`` signal per pool commit for the nodes that became ``lost``.
Transitions short of ``lost`` of every due pool are one statement
(:func:`fleet.liveness_moves.degrade`); the statements are fleet.sql's.

Two guards keep the control plane from turning its own trouble into evictions:

* **outage / clock jump**: when the sweep has not run for longer than a pool's grace, silence
  during that gap is not held against that pool's nodes: every threshold counts from the run
  that noticed the gap (``LivenessSweepState.recovered_at``).
* **mass silence** (Kubernetes' node lifecycle controller, ``unhealthyZoneThreshold`` 0.55):
  see :mod:`fleet.silence`. Where it holds, nodes still become ``unreachable`` but not ``lost``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Min
from django.utils import timezone

from nodepool import metrics

from . import clock, signals, silence, status_reports
from . import liveness_moves as moves
from .choices import Lifecycle, Liveness
from .events import Actor
from .liveness import Timings, heartbeat_population, timings_for
from .models import LivenessSweepState, Node, Pool

logger = logging.getLogger(__name__)

# The order in which the sweep moves nodes: furthest target first, so that a node silent for a
# long time goes straight to its final state with one event.
_SILENT_STATES = (Liveness.ALIVE, Liveness.STALE, Liveness.UNREACHABLE)
# How long a released mass-silence guard is remembered: longer than any pool's scaled loss threshold.
RELEASE_MEMORY_SECONDS = 24 * 3600


def _chunks(items: list, size: int = 5000):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _in_fresh_window(releases: dict, pool: Pool, candidate, *, now: datetime, lost_after: float) -> bool:
    """Whether a loss candidate ``(id, liveness, last_heartbeat_at, labels, node_labels)`` is inside
    the fresh loss window of a released guard: released at R, its leases are lost no sooner than
    R + the loss threshold."""
    key = silence.release_key_for(
        releases, pool_name=pool.name, labels=candidate[3], node_labels=candidate[4],
        trust_node_labels=pool.trust_node_labels,
    )  # fmt: skip
    if key is None:
        return False
    released_at = datetime.fromisoformat(releases[key]["released_at"])
    return (now - released_at).total_seconds() < lost_after


def _allowed(after: float, *, now: datetime, since: datetime | None) -> bool:
    """Outage guard: a threshold counts only once it has passed since the recovery too."""
    return since is None or (now - since).total_seconds() >= after


def _possible(due: dict | None, states, cutoff: datetime | None) -> bool:
    """Whether any due node in one of ``states`` can make a transition whose cutoff is ``cutoff``
    (``due``: liveness → oldest last heartbeat among the pool's due nodes; None: maybe)."""
    if due is None:
        return True
    oldest = [due[s] for s in states if s in due]
    return bool(oldest) and (cutoff is None or any(o is not None and o <= cutoff for o in oldest))


def _needs_loss_step(*, timings: Timings, now: datetime, since: datetime | None, due: dict | None) -> bool:
    """Whether a due node of the pool may be past its loss threshold (the step with guards, holds
    and the ``nodes_lost`` signal; :func:`_sweep_pool` runs it in the pool's own transaction)."""
    return _allowed(timings.lost_after, now=now, since=since) and _possible(
        due, _SILENT_STATES, now - timedelta(seconds=timings.lost_after)
    )


def _degrade_plan(
    *, pool: Pool, timings: Timings, now: datetime, since: datetime | None, due: dict | None
) -> moves.Degrade | None:
    """The pool's :class:`Degrade`, or None when none of its due nodes can move short of ``lost``."""
    cutoff = now - timedelta(seconds=timings.unreachable_after)
    if not (
        _allowed(timings.unreachable_after, now=now, since=since)
        and _possible(due, [Liveness.ALIVE, Liveness.STALE], cutoff)
    ):
        cutoff = None
    # An alive node's deadline was set by its last heartbeat (two told intervals), so no cutoff.
    to_stale = _allowed(timings.stale_after, now=now, since=since) and _possible(due, [Liveness.ALIVE], None)
    if cutoff is None and not to_stale:
        return None
    return moves.Degrade(
        pool_id=pool.pk,
        unreachable_cutoff=cutoff,
        to_stale=to_stale,
        lost_after=timings.lost_after,
        since=since,
        unreachable_reason=f"no heartbeat for {timings.unreachable_after:.0f}s (grace)",
        stale_reason=f"missed heartbeats for {timings.stale_after:.0f}s",
    )


def _sweep_pool(
    *,
    pool: Pool,
    timings: Timings,
    now: datetime,
    since: datetime | None,
    state,
    actor,
    fleet_silence=None,
    due: dict | None = None,
) -> dict:
    """Run the transitions of one pool; returns ``{"moved": {"a->b": n}, "lost": [ids], "held": n}``.

    ``due`` (from :func:`_due_by_pool`) maps each liveness of the pool's due nodes to the oldest
    last heartbeat among them: a transition none of them can make is not attempted (in the steady
    state only ``alive → stale`` is, one statement per pool). None attempts every transition.
    """

    def allowed(after: float) -> bool:
        return _allowed(after, now=now, since=since)

    def possible(states, cutoff: datetime | None) -> bool:
        return _possible(due, states, cutoff)

    result: dict = {"moved": {}, "lost": [], "held": 0, "guards": {}, "fresh": 0}

    def record(from_state, to_state, moved):
        if moved:
            key = f"{from_state}->{to_state}"
            result["moved"][key] = result["moved"].get(key, 0) + len(moved)

    lost_cutoff = now - timedelta(seconds=timings.lost_after)
    unreachable_cutoff = now - timedelta(seconds=timings.unreachable_after)
    if allowed(timings.lost_after) and possible(_SILENT_STATES, lost_cutoff):
        candidates = list(
            Node.objects.filter(
                pool=pool,
                liveness__in=_SILENT_STATES,
                next_liveness_check_at__lte=now,
                last_heartbeat_at__lte=lost_cutoff,
            )
            .exclude(lifecycle=Lifecycle.RETIRED)
            .values_list("id", "liveness", "last_heartbeat_at", "labels", "node_labels")
        )
        if candidates:
            verdict = silence.evaluate_pool(
                pool=pool, now=now, unreachable_cutoff=unreachable_cutoff, trust_node_labels=pool.trust_node_labels,
                fleet=fleet_silence() if fleet_silence else None,
            )  # fmt: skip
            result["guards"] = verdict.guards
            held = [c for c in candidates if verdict.holds(c[3], c[4])]
            # A guard of this pool that held at the previous run and holds no more is released
            # now: nodes still silent get a fresh loss window from here (Kubernetes and Nomad
            # restart the clock when a disruption ends), never their silence from before it.
            releases = state.guard_releases
            for key in state.guarded_groups or {}:
                if silence.belongs_to_pool(key, pool.name) and key not in verdict.guards and key not in releases:
                    releases[key] = {"released_at": now.isoformat()}
            held_ids = {c[0] for c in held}
            fresh = [
                c
                for c in candidates
                if c[0] not in held_ids and _in_fresh_window(releases, pool, c, now=now, lost_after=timings.lost_after)
            ]
            result["fresh"] = len(fresh)
            eligible = {c[0] for c in candidates} - held_ids - {c[0] for c in fresh}
            if held:
                result["held"] = len(held)
                silence.record_withheld(
                    held=held, verdict=verdict, state=state, now=now, lost_after=timings.lost_after, actor=actor
                )
            reason = f"no heartbeat for {timings.lost_after:.0f}s (loss threshold)"
            for from_state in _SILENT_STATES:
                # Without holds the cutoff alone selects the rows; with holds, the eligible ids do.
                batches = [None]
                if held or fresh:
                    batches = list(_chunks([c[0] for c in candidates if c[1] == from_state and c[0] in eligible]))
                for batch in batches:
                    moved = moves.move(
                        pool_id=pool.pk,
                        from_state=from_state,
                        to_state=Liveness.LOST,
                        now=now,
                        cutoff=lost_cutoff,
                        next_offset=None,
                        reference=since,
                        ids=batch,
                        actor=actor,
                        reason=reason,
                    )
                    record(from_state, Liveness.LOST, moved)
                    result["lost"].extend(moved)
    plan = _degrade_plan(pool=pool, timings=timings, now=now, since=since, due=due)
    if plan is not None:
        for key, count in moves.degrade([plan], now=now, actor=actor).get(pool.pk, {}).items():
            result["moved"][key] = result["moved"].get(key, 0) + count
    return result


def _due_by_pool(now: datetime) -> dict[int, dict[str, datetime | None]]:
    """``{pool pk: {liveness: oldest last heartbeat}}`` of the nodes whose deadline passed (one
    aggregate query over the deadline index ``node_liveness_due``): which pools to sweep, and which
    of their transitions can move anyone (:func:`_sweep_pool`). A node changed after this read is
    judged by the compare-and-swap of each move anyway; one that becomes due meanwhile waits a run."""
    rows = (
        Node.objects.filter(next_liveness_check_at__lte=now)
        .exclude(lifecycle=Lifecycle.RETIRED)
        .values_list("pool_id", "liveness")
        .annotate(oldest=Min("last_heartbeat_at"))
        .order_by()
    )
    due: dict = {}
    for pool_id, liveness, oldest in rows:
        due.setdefault(pool_id, {})[liveness] = oldest
    return due


def _open_releases(releases: dict, *, now: datetime, engaged: dict) -> dict:
    """The releases still worth remembering: a window lasts one loss threshold (at most the largest
    a pool may have, a day here, so stale entries go), and a guard engaged again ends its release."""
    keep = {}
    for key, release in releases.items():
        if key in engaged:
            continue
        if (now - datetime.fromisoformat(release["released_at"])).total_seconds() <= RELEASE_MEMORY_SECONDS:
            keep[key] = release
    return keep


def sweep_liveness(*, now: datetime | None = None, actor: Actor | None = None) -> dict:
    """Degrade the liveness of every node whose deadline passed; safe to run twice at once.

    Three steps (healthchecks' sweeper isolates each check the same way):

    1. **Fleet-wide verdicts, once**, under the sweep state row's lock (a short transaction): the
       gap since the last run and what it was. A gap longer than a due pool's grace is an
       **outage** or a forward clock jump when at least the guard's unhealthy fraction of live
       nodes had their deadline pass during it (nobody could be heard): grace then restarts now
       (``recovered_at``). Otherwise it was a **stall** of the sweep while renewals kept arriving
       (:func:`fleet.clock.renewals_kept_arriving`): every node is judged by its own last renewal,
       so a node that died during the stall is marked by this very run.
    2. **The pools.** Pools whose due nodes only degrade short of ``lost`` (``stale``,
       ``unreachable``: the steady state, and a mass ``alive → stale``) are moved **together**, in
       one transaction and, on PostgreSQL, one statement (:func:`fleet.liveness_moves.degrade`), so 100 due pools cost
       what one costs. Each pool where a node may be past its loss threshold is swept **alone**,
       in its own transaction committed on its own, with ``nodes_lost`` sent inside it for that
       pool's lost nodes. If the together-transaction fails, it is rolled back and each of its
       pools is swept alone. A pool that fails alone is rolled back, logged
       (``liveness_sweep_pool_failed``), counted (``nodepool_liveness_sweep_pool_failures_total{pool}``)
       and skipped: the next run tries it again; the other pools are not held back. The fleet's
       silence figures for the mass-silence guard are computed once, by the first pool needing them.
       The fleet size (which scales the thresholds) is :func:`heartbeat_population`'s cached count,
       the one renewals are told their interval from (at most 30 s old), not a fresh count per run.
    3. **The state row again**, locked: guards engaged and released, ``last_run_at``, the summary.

    Args:
        now: the server's time (default: now). Tests move it with time_machine.
        actor: who runs it (default: the system task ``fleet.sweep_liveness``).

    Returns:
        ``{"now", "gap_seconds", "gap" ("", "stall" or "outage"), "recovering", "moved":
        {"alive->stale": n, ...}, "lost": n, "held": n, "guards": {...}, "failed_pools": [names],
        "status_reports_overdue": n}``.
    """
    now = now or timezone.now()
    actor = actor or Actor.system("fleet.sweep_liveness")
    # Deadlines first: a forward gap of the clock is paused for credentials, leases, drains…
    clock.observe(now=now, actor=actor)
    LivenessSweepState.objects.get_or_create(pk=1)
    summary: dict = {"now": now.isoformat(), "moved": {}, "lost": 0, "held": 0, "guards": {}, "recovering": False}
    with transaction.atomic():
        # The row lock makes the verdicts of concurrent sweeps queue (PostgreSQL); SQLite's
        # IMMEDIATE transactions already serialise writers. The per-row compare-and-swap of every
        # transition keeps two sweeps at once correct without it.
        state = LivenessSweepState.objects.select_for_update().get(pk=1)
        previous = state.last_run_at
        gap = max(0.0, (now - previous).total_seconds()) if previous else 0.0
        due = _due_by_pool(now)
        due_pools = list(Pool.objects.filter(pk__in=list(due)).order_by("name"))
        fleet_size = heartbeat_population()
        pool_timings = {pool.pk: timings_for(pool, fleet_size) for pool in due_pools}
        summary["gap_seconds"], summary["gap"] = round(gap, 3), ""
        if previous is not None and pool_timings and gap > min(t.unreachable_after for t in pool_timings.values()):
            if clock.renewals_kept_arriving(started_at=previous, ended_at=now):
                summary["gap"] = "stall"  # the sweep stopped, the API did not: nothing to forgive
                logger.warning("liveness: the sweep stalled for %ss while renewals kept arriving", round(gap, 3))
            else:
                # The control plane itself was away (or its clock jumped): grace restarts now.
                summary["gap"] = "outage"
                state.recovered_at, state.gap_seconds = now, gap
                state.save(update_fields=["recovered_at", "gap_seconds"])
    cutoffs = {pool.pk: now - timedelta(seconds=pool_timings[pool.pk].unreachable_after) for pool in due_pools}
    fleet_figures: list = []

    def fleet_silence() -> dict:
        if not fleet_figures:
            fleet_figures.append(silence.fleet_silence(now=now, unreachable_cutoffs=cutoffs))
        return fleet_figures[0]

    def since_for(timings: Timings) -> datetime | None:
        # The recovery matters for one loss threshold after it; later every node is judged
        # by its own last heartbeat again (the result would be the same, the summary clearer).
        return (
            state.recovered_at
            if state.recovered_at is not None
            and state.gap_seconds > timings.unreachable_after
            and (now - state.recovered_at).total_seconds() <= timings.lost_after
            else None
        )

    def add(result: dict, since: datetime | None) -> None:
        summary["recovering"] = summary["recovering"] or since is not None
        for key, count in result["moved"].items():
            summary["moved"][key] = summary["moved"].get(key, 0) + count
        summary["lost"] += len(result["lost"])
        summary["held"] += result["held"]
        summary["fresh_window"] = summary.get("fresh_window", 0) + result["fresh"]
        summary["guards"].update(result["guards"])

    failed: list[str] = []

    def sweep_alone(pool: Pool) -> None:
        """One pool in its own transaction, committed on its own; a failure is logged, counted, skipped."""
        timings, since = pool_timings[pool.pk], since_for(pool_timings[pool.pk])
        try:
            with transaction.atomic():
                result = _sweep_pool(
                    pool=pool, timings=timings, now=now, since=since, state=state, actor=actor,
                    fleet_silence=fleet_silence, due=due[pool.pk],
                )  # fmt: skip
                if result["lost"]:
                    signals.nodes_lost.send(
                        sender=Node,
                        node_ids=result["lost"],
                        actor=actor,
                        reason="node lost: no heartbeat past the loss threshold",
                    )
        except Exception:  # one pool's failure must not hold back the others (it is retried next run)
            logger.exception("liveness_sweep_pool_failed pool=%s", pool.name, extra={"pool": pool.name})
            metrics.LIVENESS_SWEEP_POOL_FAILURES.labels(pool=pool.name).inc()
            failed.append(pool.name)
            return
        add(result, since)

    # Pools where a node may be past its loss threshold each get their own transaction (guards,
    # holds, the nodes_lost signal). Every other due pool only degrades nodes short of `lost`:
    # all of them together in one transaction, one statement on PostgreSQL (the steady state and a
    # mass alive -> stale cost what one pool costs, however many pools there are). If that
    # transaction fails, each of its pools is swept alone, so a failing pool is still isolated.
    alone: list[Pool] = []
    together: dict[int, tuple[Pool, moves.Degrade | None]] = {}
    for pool in due_pools:
        timings, since = pool_timings[pool.pk], since_for(pool_timings[pool.pk])
        if _needs_loss_step(timings=timings, now=now, since=since, due=due[pool.pk]):
            alone.append(pool)
        else:
            together[pool.pk] = (
                pool,
                _degrade_plan(pool=pool, timings=timings, now=now, since=since, due=due[pool.pk]),
            )
    plans = [plan for _, plan in together.values() if plan is not None]
    try:
        with transaction.atomic():
            counts = moves.degrade(plans, now=now, actor=actor)
    except Exception:
        logger.warning("liveness_sweep_batch_failed pools=%d: sweeping each alone", len(plans), exc_info=True)
        alone = sorted([*alone, *(pool for pool, plan in together.values() if plan is not None)], key=lambda p: p.name)
    else:
        for pool, _plan in together.values():
            add({"moved": counts.get(pool.pk, {}), "lost": [], "held": 0, "fresh": 0, "guards": {}},
                since_for(pool_timings[pool.pk]))  # fmt: skip
    for pool in alone:
        sweep_alone(pool)
    summary["failed_pools"] = failed
    releases_found = state.guard_releases or {}
    with transaction.atomic():
        state = LivenessSweepState.objects.select_for_update().get(pk=1)
        previous_guards = state.guarded_groups or {}
        # A failed pool was not judged: its guards stand as they were.
        for key, guard in previous_guards.items():
            if key != silence.FLEET and key.split("/", 1)[0] in failed:
                summary["guards"].setdefault(key, guard)
        releases = {**(state.guard_releases or {}), **releases_found}
        for key in previous_guards:
            # Released where no pool of it was judged this run (every silent node came back):
            # nodes that go silent again later still count from this release.
            if key not in summary["guards"] and key not in releases:
                releases[key] = {"released_at": now.isoformat()}
        pools = {pool.name: pool for pool in due_pools}
        missing = {key.split("/", 1)[0] for key in {*previous_guards, *summary["guards"]} if key != silence.FLEET}
        pools.update({p.name: p for p in Pool.objects.filter(name__in=missing - set(pools))})
        silence.record_guard_changes(
            previous=previous_guards, current=summary["guards"], pools=pools, now=now, actor=actor
        )
        state.guard_releases = _open_releases(releases, now=now, engaged=summary["guards"])
        state.last_run_at = max(now, state.last_run_at) if state.last_run_at else now
        state.guarded_groups = summary["guards"]
        state.last_result = {k: v for k, v in summary.items() if k != "guards"}
        state.save(update_fields=["last_run_at", "guarded_groups", "guard_releases", "last_result"])
    # Nodes that renew but stopped reporting their status: not dead, but not schedulable either.
    summary["status_reports_overdue"] = status_reports.mark_overdue(now=now, actor=actor)
    return summary
