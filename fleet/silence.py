"""The mass-silence guard: when much of the fleet, a pool or a zone goes silent at once, the control
plane is probably the one cut off, so it keeps marking nodes ``unreachable`` but stops declaring
their leases lost until the silent fraction falls.

The rule is Kubernetes' node lifecycle controller (``unhealthyZoneThreshold`` = 0.55,
``handleDisruption``), with pools in the role of the cluster:

* the whole fleet, or a whole pool, more than ``NODEPOOL["UNHEALTHY_ZONE_FRACTION"]`` silent:
  hold every loss there (Kubernetes stops all evictions when every zone is fully disrupted);
* a zone of a pool partially disrupted (more than the fraction silent, but not all of it): hold
  losses in that zone (Kubernetes stops evicting in a partially disrupted zone of a small cluster);
* a zone entirely silent while the rest of its pool answers: that zone failed; its leases are
  lost normally (Kubernetes evicts a fully disrupted zone at the normal rate).

A group needs at least ``NODEPOOL["UNHEALTHY_ZONE_MIN_NODES"]`` (3) silent nodes to count as
disrupted, so that a pool of one or two nodes still loses its leases when they die.

The zone is the label ``topology.kubernetes.io/zone``, else ``zone`` (the platform's ``labels``;
the node's own ``node_labels`` only in pools that trust them); nodes without one share zone ``""``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import CharField, Count, Q, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Coalesce

from . import conf, event_types
from .choices import Lifecycle, Liveness
from .events import event_row
from .models import Node, NodeEvent

logger = logging.getLogger(__name__)

ZONE_LABELS = ("topology.kubernetes.io/zone", "zone")
FLEET = "*"


def zone_of(labels: dict | None, node_labels: dict | None = None, *, trust_node_labels: bool = False) -> str:
    """The zone of a node from its labels (see the module docstring); ``""`` when it has none."""
    sources = [labels or {}] + ([node_labels or {}] if trust_node_labels else [])
    for source in sources:
        for key in ZONE_LABELS:
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, str) and value:
                return value
    return ""


def _fraction() -> float:
    return conf.get("UNHEALTHY_ZONE_FRACTION")


def _min_nodes() -> int:
    return conf.get("UNHEALTHY_ZONE_MIN_NODES")


@dataclass
class Verdict:
    """Where a pool's losses are held. ``guards`` maps ``"<pool>/<zone>"`` (or ``"*"``, ``"<pool>/*"``)
    to ``{"scope", "silent", "total", "fraction"}`` for every group that is held."""

    pool_name: str
    trust_node_labels: bool
    pool_held: bool = False
    held_zones: set[str] = field(default_factory=set)
    guards: dict = field(default_factory=dict)

    def key_for(self, labels, node_labels) -> str | None:
        """The guard that holds a node with these labels, or None."""
        if FLEET in self.guards:
            return FLEET
        if self.pool_held:
            return f"{self.pool_name}/*"
        zone = zone_of(labels, node_labels, trust_node_labels=self.trust_node_labels)
        return f"{self.pool_name}/{zone}" if zone in self.held_zones else None

    def holds(self, labels, node_labels) -> bool:
        return self.key_for(labels, node_labels) is not None


def _disrupted(silent: int, total: int) -> bool:
    return total > 0 and silent >= _min_nodes() and silent / total > _fraction()


def _silent_q(now: datetime, unreachable_cutoff: datetime) -> Q:
    # Silent: already unreachable/lost, or due to become unreachable in this very sweep.
    return Q(liveness__in=[Liveness.UNREACHABLE, Liveness.LOST]) | Q(
        liveness__in=[Liveness.ALIVE, Liveness.STALE],
        next_liveness_check_at__lte=now,
        last_heartbeat_at__lte=unreachable_cutoff,
    )


def _tracked():
    return Node.objects.exclude(lifecycle=Lifecycle.RETIRED).exclude(liveness=Liveness.UNKNOWN)


def fleet_silence(*, now: datetime, unreachable_cutoffs: dict) -> dict:
    """``{"silent", "total"}`` over the whole fleet (one aggregate query), each due pool judged by its
    own grace: ``unreachable_cutoffs`` maps pool pk → the last-heartbeat time at or before which its
    due nodes become unreachable. Nodes of other pools count as silent only once unreachable or lost
    (none of them is due)."""
    due = Q(pk__in=[])
    for pool_id, cutoff in unreachable_cutoffs.items():
        due |= Q(
            pool_id=pool_id,
            liveness__in=[Liveness.ALIVE, Liveness.STALE],
            next_liveness_check_at__lte=now,
            last_heartbeat_at__lte=cutoff,
        )
    silent_q = Q(liveness__in=[Liveness.UNREACHABLE, Liveness.LOST]) | due
    return _tracked().aggregate(total=Count("id"), silent=Count("id", filter=silent_q))


def evaluate_pool(
    *, pool, now: datetime, unreachable_cutoff: datetime, trust_node_labels: bool = False, fleet: dict | None = None
) -> Verdict:
    """Decide where losses are held in ``pool`` at ``now`` (two aggregate queries; one when the
    fleet-wide figures ``fleet`` (:func:`fleet_silence`) were computed once for the whole sweep)."""
    verdict = Verdict(pool_name=pool.name, trust_node_labels=trust_node_labels)
    silent_q = _silent_q(now, unreachable_cutoff)
    if fleet is None:
        fleet = _tracked().aggregate(total=Count("id"), silent=Count("id", filter=silent_q))
    if _disrupted(fleet["silent"], fleet["total"]):
        verdict.guards[FLEET] = _guard("fleet", fleet["silent"], fleet["total"])
        return verdict
    zone_sources = [KT(f"labels__{key}") for key in ZONE_LABELS]
    if trust_node_labels:
        zone_sources += [KT(f"node_labels__{key}") for key in ZONE_LABELS]
    rows = (
        _tracked()
        .filter(pool=pool)
        .annotate(zone=Coalesce(*zone_sources, Value(""), output_field=CharField()))
        .values("zone")
        .annotate(total=Count("id"), silent=Count("id", filter=silent_q))
    )
    zones = {row["zone"] or "": (row["silent"], row["total"]) for row in rows}
    pool_silent = sum(s for s, _ in zones.values())
    pool_total = sum(t for _, t in zones.values())
    if _disrupted(pool_silent, pool_total):
        verdict.pool_held = True
        verdict.guards[f"{pool.name}/*"] = _guard("pool", pool_silent, pool_total)
        return verdict
    for zone, (silent, total) in zones.items():
        if _disrupted(silent, total) and silent < total:
            verdict.held_zones.add(zone)
            verdict.guards[f"{pool.name}/{zone}"] = _guard("zone", silent, total)
    return verdict


def release_key_for(releases: dict, *, pool_name: str, labels, node_labels, trust_node_labels: bool) -> str | None:
    """The released guard whose fresh loss window covers a node with these labels, or None.

    ``releases`` maps a guard key (``"*"``, ``"<pool>/*"``, ``"<pool>/<zone>"``) to
    ``{"released_at": iso time, ...}``; the caller decides whether the window is still open.
    """
    if FLEET in releases:
        return FLEET
    if f"{pool_name}/*" in releases:
        return f"{pool_name}/*"
    key = f"{pool_name}/{zone_of(labels, node_labels, trust_node_labels=trust_node_labels)}"
    return key if key in releases else None


def belongs_to_pool(key: str, pool_name: str) -> bool:
    """Whether guard ``key`` covers (some of) pool ``pool_name``: the fleet guard covers every pool."""
    return key == FLEET or key.startswith(f"{pool_name}/")


def record_guard_changes(*, previous: dict, current: dict, pools: dict, now: datetime, actor) -> list[NodeEvent]:
    """One ``guard`` event per guard engaged (in ``current``, not ``previous``) or released (the reverse).

    ``pools`` maps pool names to Pool instances (events of a pool or zone guard belong to that
    pool; the fleet guard's to none). Returns the events written.
    """
    rows = []
    for key in sorted(set(previous) ^ set(current)):
        engaged = key in current
        guard = current[key] if engaged else previous[key]
        pool = pools.get(key.split("/", 1)[0]) if key != FLEET else None
        if engaged:
            reason = (
                f"mass-silence guard engaged: {guard['silent']}/{guard['total']} nodes of {guard['scope']} {key} "
                f"are silent (more than {_fraction():.0%}); lease loss is withheld there"
            )
        else:
            reason = (
                f"mass-silence guard released for {guard['scope']} {key}: nodes still silent get a fresh "
                "loss window counted from now"
            )
        rows.append(
            event_row(
                None,
                event_types.GUARD,
                actor,
                from_state="" if engaged else "engaged",
                to_state="engaged" if engaged else "released",
                reason=reason,
                pool=pool,
                subject_type="guard",
                subject_id=key,
                data={"guard": key, **guard, "at": now.isoformat()},
            )
        )
        log = logger.warning if engaged else logger.info
        log(
            "liveness: mass-silence guard %s for %s %s: %s",
            "engaged" if engaged else "released",
            guard["scope"],
            key,
            guard,
        )
    NodeEvent.objects.bulk_create(rows)
    return rows


def _guard(scope: str, silent: int, total: int) -> dict:
    return {"scope": scope, "silent": silent, "total": total, "fraction": round(silent / total, 3)}


def record_withheld(*, held: list, verdict: Verdict, state, now: datetime, lost_after: float, actor) -> int:
    """Append one event per node whose loss is withheld, once per guard episode.

    ``held`` rows are ``(id, liveness, last_heartbeat_at, labels, node_labels)``. A node gets the
    event when its guard was not active at the previous run or its loss fell due since then.
    Returns the number of events written.
    """
    previous_run = state.last_run_at
    previous_guards = state.guarded_groups or {}
    rows = []
    for node_id, liveness, last_heartbeat_at, labels, node_labels in held:
        key = verdict.key_for(labels, node_labels)
        newly_due = previous_run is None or last_heartbeat_at + timedelta(seconds=lost_after) > previous_run
        if key in previous_guards and not newly_due:
            continue
        guard = verdict.guards[key]
        reason = (
            f"lease loss withheld: {guard['silent']}/{guard['total']} nodes of {guard['scope']} {key} are silent "
            f"(more than {_fraction():.0%}); the control plane may be the one cut off"
        )
        rows.append(
            event_row(
                node_id,
                event_types.LIVENESS,
                actor,
                from_state=liveness,
                to_state=Liveness.UNREACHABLE,
                reason=reason,
                data={"loss_withheld": True, "guard": key, **guard},
            )
        )
    NodeEvent.objects.bulk_create(rows, batch_size=500)
    return len(rows)
