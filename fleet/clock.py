"""Control-plane time: the wall clock, standing still across the gaps the control plane detects.

A forward step of the server clock (an NTP step after a long suspend, a VM restored from a
snapshot) or an outage of the control plane itself makes every deadline computed from the wall
clock fall due at once: node credentials, leases, drain deadlines, bootstrap tokens, holds. Nodes
could not have renewed anything during such a gap, so the control plane does not count it against
them: **control-plane time pauses during a detected gap**.

Mechanism (one row, :class:`fleet.models.ControlPlaneClock`):

* every periodic job that acts on deadlines calls :func:`observe` first (the liveness sweep,
  the lease-expiry sweep, the drain sweep and deadline task). When the wall clock moved more than
  ``NODEPOOL["CLOCK_JUMP_THRESHOLD"]`` (60 s) since the last observation, the gap beyond one
  sweep interval is *paused*: every live deadline that had not passed when the gap began is moved
  later by the paused length (set-based UPDATEs, in one transaction under the row's lock, so two
  sweeps noticing the same gap shift once), and one ``clock_jump`` event is written.
  ``clock_gap_detected`` (a signal) lets the higher apps shift theirs (leases, drains, holds)
  without fleet importing them.
* the web path never waits for a sweep: a credential, lease or bootstrap token that looks expired
  by the wall clock is judged again against :func:`control_plane_now`, which, while a gap is
  still undetected (the last observation is older than the threshold), stands still at the last
  observation plus one sweep interval. So the very first heartbeat after a jump is not refused.
  Superseded credentials (rotated: a newer one exists) never get this grace and are not shifted.
* a backward jump pauses nothing; deadlines then simply last longer by the jump (the safe side).
* a **stall** is not a gap: when only the periodic jobs stopped (beat or the worker) while the API
  kept serving renewals, the nodes' liveness deadlines kept moving; :func:`renewals_kept_arriving`
  tells the two apart (the share of live nodes whose deadline passed during the gap, below the
  mass-silence guard's unhealthy fraction), and a stall pauses nothing.

The liveness sweep's own outage guard (``LivenessSweepState.recovered_at``) restarts silence
counting after the same kind of gap; see docs/heartbeats.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F
from django.dispatch import Signal
from django.utils import timezone

from . import conf, event_types
from .choices import Lifecycle, Liveness
from .events import Actor, record_event
from .models import Benchmark, BootstrapToken, ControlPlaneClock, Node, NodeCredential, NodeEvent

logger = logging.getLogger(__name__)

# Sent inside observe()'s transaction when a forward gap is detected; receivers move their own
# live deadlines later. Keyword arguments: started_at, ended_at (aware datetimes), paused
# (timedelta), actor. Receivers return {name: rows shifted}, recorded on the clock_jump event.
clock_gap_detected = Signal()


@dataclass(frozen=True)
class Gap:
    """A detected forward gap: the wall clock went from ``started_at`` to ``ended_at``; ``paused``
    (``ended_at - started_at`` minus one expected sweep interval) is credited to every deadline."""

    started_at: datetime
    ended_at: datetime
    paused: timedelta
    shifted: dict


def threshold_seconds() -> float:
    return conf.get("CLOCK_JUMP_THRESHOLD")


def interval_seconds() -> float:
    return conf.get("LIVENESS_SWEEP_INTERVAL")


def control_plane_now(now: datetime | None = None) -> datetime:
    """The time deadlines are judged against on the web path: the wall clock, except while a gap
    is pending detection, when it stands at the last observation plus one sweep interval.

    One query (the clock row); callers use it only for something that already looks expired by
    the wall clock, so the hot path pays nothing when all is well. With no observation yet (no
    sweep ever ran) it is the wall clock.
    """
    now = now or timezone.now()
    observed_at = ControlPlaneClock.objects.filter(pk=1).values_list("observed_at", flat=True).first()
    if observed_at is None or (now - observed_at).total_seconds() <= threshold_seconds():
        return now
    return min(now, observed_at + timedelta(seconds=interval_seconds()))


def still_valid(expires_at: datetime, now: datetime | None = None) -> bool:
    """Whether a deadline that is ``expires_at`` holds at control-plane time (see :func:`control_plane_now`)."""
    now = now or timezone.now()
    return expires_at > now or expires_at > control_plane_now(now)


def detected_gaps() -> list[tuple[datetime, timedelta]]:
    """The gaps detected and paused, oldest first: ``[(started_at, paused)]``.

    Read from the ``clock_jump`` events :func:`observe` writes (rare rows: one per gap; event
    retention may drop old ones, long after any toleration they could matter to). For
    deadlines that are computed, not stored, such as a ``NoExecute`` taint's
    ``toleration_seconds`` (:func:`extend_past_gaps`).
    """
    gaps = []
    for data in NodeEvent.objects.filter(type=event_types.CLOCK_JUMP).values_list("data", flat=True):
        try:
            gaps.append((datetime.fromisoformat(data["started_at"]), timedelta(seconds=float(data["paused_seconds"]))))
        except (KeyError, TypeError, ValueError):
            continue
    return sorted(gaps)


def extend_past_gaps(since: datetime, until: datetime, gaps: list[tuple[datetime, timedelta]]) -> datetime:
    """A computed deadline ``until`` (counted from ``since``) moved later by every paused gap that
    began between the two, as if control-plane time had stood still (``gaps`` from
    :func:`detected_gaps`, oldest first)."""
    for started_at, paused in gaps:
        if since <= started_at < until:
            until += paused
    return until


def unhealthy_fraction() -> float:
    """The mass-silence guard's fraction (``NODEPOOL["UNHEALTHY_ZONE_FRACTION"]``, 0.55)."""
    return conf.get("UNHEALTHY_ZONE_FRACTION")


def renewals_kept_arriving(*, started_at: datetime, ended_at: datetime) -> bool:
    """Whether a gap between two runs of the control plane's periodic jobs was a **stall** of those
    jobs (the API kept serving renewals) rather than an outage or a forward clock jump.

    The test: the share of live nodes (liveness ``alive`` with a deadline, not retired) whose liveness deadline
    (``Node.next_liveness_check_at``) passed during the gap, ``started_at < deadline <= ended_at``.
    Every renewal pushes its node's deadline ahead, so while renewals keep arriving only the nodes
    that really went silent have a passed deadline; when nobody could be heard (an outage) or the
    clock stepped forward, nearly every live node's deadline passed. A share below the mass-silence
    guard's unhealthy fraction (0.55, :func:`unhealthy_fraction`) is a stall. No live node with a
    deadline answers False (treated as an outage, as before this rule). Two counts; the deadline range is
    served by the partial index ``node_liveness_due``. Nothing is added to the renewal path.
    """
    live = Node.objects.filter(liveness=Liveness.ALIVE, next_liveness_check_at__isnull=False).exclude(
        lifecycle=Lifecycle.RETIRED
    )
    total = live.count()
    if total == 0:
        return False
    passed = live.filter(next_liveness_check_at__gt=started_at, next_liveness_check_at__lte=ended_at).count()
    return passed / total < unhealthy_fraction()


def observe(*, now: datetime | None = None, actor: Actor | None = None) -> Gap | None:
    """Record that the control plane is running at ``now``; detect and pause a forward gap.

    Safe to call concurrently and repeatedly: the clock row is locked, and a gap is detected by
    the first caller that sees it (the next one finds ``observed_at`` already moved on).

    Returns: the :class:`Gap` detected by this call, or None.
    """
    now = now or timezone.now()
    actor = actor or Actor.system("fleet.clock")
    ControlPlaneClock.objects.get_or_create(pk=1)
    with transaction.atomic():
        clock = ControlPlaneClock.objects.select_for_update().get(pk=1)
        previous = clock.observed_at
        if previous is not None and now <= previous:
            return None  # the clock stepped back, or a concurrent caller got here first
        clock.observed_at = now
        gap = None
        if (
            previous is not None
            and (now - previous).total_seconds() > threshold_seconds()
            and renewals_kept_arriving(started_at=previous, ended_at=now)
        ):
            # Only the periodic jobs stalled (beat or the worker): nodes kept renewing, so control-plane
            # time did not stand still for them; extending every deadline would be wrong.
            logger.warning(
                "clock: %ss between two observations, but renewals kept arriving: a stall of the periodic "
                "jobs, not a clock jump or an outage; nothing paused",
                round((now - previous).total_seconds(), 3),
            )
        elif previous is not None and (now - previous).total_seconds() > threshold_seconds():
            paused = (now - previous) - timedelta(seconds=interval_seconds())
            # Every node first, in key order, like any multi-node lock: the shifts below update
            # leases, drains and holds across the fleet in bulk, whereas a drain evaluation or a
            # quarantine holds its node, then its drain and leases. Taking the nodes first turns
            # what would be a deadlock with such a node action into a wait. A gap is rare; the
            # lock lasts this one transaction.
            list(Node.objects.select_for_update(no_key=True).order_by("pk").values_list("pk", flat=True))
            shifted = shift_deadlines(started_at=previous, paused=paused)
            for _receiver, answer in clock_gap_detected.send(
                sender=ControlPlaneClock, started_at=previous, ended_at=now, paused=paused, actor=actor
            ):
                shifted.update(answer or {})
            clock.paused_seconds += paused.total_seconds()
            clock.last_gap_started_at, clock.last_gap_ended_at = previous, now
            gap = Gap(started_at=previous, ended_at=now, paused=paused, shifted=shifted)
            record_event(
                None,
                event_types.CLOCK_JUMP,
                actor,
                reason=(
                    f"the control plane's clock moved {(now - previous).total_seconds():.0f}s between two "
                    f"observations (more than {threshold_seconds():.0f}s): {paused.total_seconds():.0f}s were "
                    "paused, so no credential, lease, drain deadline or bootstrap token expired for it"
                ),
                data={
                    "started_at": previous.isoformat(),
                    "ended_at": now.isoformat(),
                    "paused_seconds": paused.total_seconds(),
                    "shifted": shifted,
                },
            )
            logger.warning("clock: gap of %ss detected and paused: %s", paused.total_seconds(), shifted)
        clock.save()
    return gap


def shift_deadlines(*, started_at: datetime, paused: timedelta) -> dict:
    """Move fleet's live deadlines that had not passed at ``started_at`` later by ``paused``.

    Credentials: unrevoked and not superseded (``rotated_at`` unset). Bootstrap tokens: unrevoked.
    Benchmarks: still requested. Returns ``{name: rows}``.
    """
    return {
        "credentials": NodeCredential.objects.filter(
            revoked_at__isnull=True, rotated_at__isnull=True, superseded_by__isnull=True, expires_at__gt=started_at
        ).update(expires_at=F("expires_at") + paused),
        "bootstrap_tokens": BootstrapToken.objects.filter(revoked_at__isnull=True, expires_at__gt=started_at).update(
            expires_at=F("expires_at") + paused
        ),
        "benchmarks": Benchmark.objects.filter(status="requested", deadline__gt=started_at).update(
            deadline=F("deadline") + paused
        ),
    }
