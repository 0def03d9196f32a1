"""Leases and the node reliability record: how each ended lease counts for or against its node,
and reliability as a placement constraint and preference.

**Counting** (definitions in fleet.reliability and docs/fleet.md, "Reliability"): the
``lease_ended`` receiver :func:`count_lease_outcome` classifies the lease with :func:`classify`
in the transaction that ends it — where the node's liveness, lifecycle and restarts are still
what they were when it ended — and adds it to the node's day row.

**Placing** (docs/leases.md, "Reliability"): a request may carry::

    "node_constraints": [{"attribute": "reliability", "operator": ">=", "value": 0.99}],
    "node_preferences": [{"weight": 50, "attribute": "reliability", "operator": ">=", "value": 0.999}]

with the numeric comparison grammar of device constraints (nodepool.comparison: ``=``, ``!=``,
``>``, ``>=``, ``<``, ``<=``). A constraint is a filter (in the candidate SQL, on the stored
``Node.reliability`` column: no per-request computation), a preference scores like Kubernetes'
preferred node affinity (the weights of the preferences a node meets, out of their sum, 0-100).
An unrated node (no score yet) meets no constraint and no preference. The 409's census counts
the nodes that fail under ``reliability_unrated`` / ``reliability_not_met`` ("3 node(s) had
reliability below 0.99").
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Case, Q, Value, When

from fleet import conf as fleet_conf
from fleet import event_types as fleet_event_types
from fleet.choices import LeaseOutcome, Lifecycle, Liveness
from fleet.models import Node, NodeEvent
from fleet.reliability import record_lease_outcome
from nodepool.comparison import NUMERIC_OPERATORS, Comparison, ComparisonError

from .choices import DEVICE_FAULT_REVOKE_PREFIX, LeaseState, ReleaseOutcome, WorkloadState
from .errors import INVALID_NODE_CONSTRAINT

NODE_ATTRIBUTES = {"reliability": "reliability"}  # attribute -> Node column (a number in [0, 1])
MAX_NODE_CONSTRAINTS = 8
UNRATED = "reliability_unrated"
NOT_MET = "reliability_not_met"
CENSUS_KEY = "g_node_constraint"


# --- counting ------------------------------------------------------------------------------------
def classify(lease, *, node: dict, now) -> str | None:
    """The :class:`fleet.choices.LeaseOutcome` of an ended ``lease``, or None when it does not count.

    ``node``: the node's ``liveness`` and ``lifecycle`` as the ending transaction sees them.

    - released → ``completed``, unless it failed (outcome or reported workload state ``failed``)
      within ``RELIABILITY_RESTART_WINDOW`` seconds after an unplanned restart (a ``restart``
      event after the grant, the node not draining or in maintenance) → ``failed_after_restart``;
    - lost → ``lost_unreachable`` when the node is unreachable or lost, else ``lost_on_restart``
      when it restarted since the grant, else ``lost_unreported`` (alive, but it stopped listing
      the lease: leases.reconcile);
    - revoked → ``revoked_device_fault`` when a device fault revoked it (leases.device_faults),
      ``revoked_quarantine`` when the node is quarantined, else None (an operator, a drain,
      preemption: not the node's doing);
    - expired → None (the client stopped renewing).
    """
    if lease.state == LeaseState.RELEASED:
        failed = lease.outcome == ReleaseOutcome.FAILED or lease.workload_state == WorkloadState.FAILED
        planned = node["lifecycle"] in (Lifecycle.DRAINING, Lifecycle.MAINTENANCE)
        window = timedelta(seconds=fleet_conf.get("RELIABILITY_RESTART_WINDOW"))
        if failed and not planned and _restarted(lease, since=max(lease.granted_at, now - window)):
            return LeaseOutcome.FAILED_AFTER_RESTART
        return LeaseOutcome.COMPLETED
    if lease.state == LeaseState.LOST:
        if node["liveness"] in (Liveness.UNREACHABLE, Liveness.LOST):
            return LeaseOutcome.LOST_UNREACHABLE
        if _restarted(lease, since=lease.granted_at):
            return LeaseOutcome.LOST_ON_RESTART
        return LeaseOutcome.LOST_UNREPORTED
    if lease.state == LeaseState.REVOKED:
        if (lease.end_reason or "").startswith(DEVICE_FAULT_REVOKE_PREFIX):
            return LeaseOutcome.REVOKED_DEVICE_FAULT
        if node["lifecycle"] == Lifecycle.QUARANTINED:
            return LeaseOutcome.REVOKED_QUARANTINE
    return None


def _restarted(lease, *, since) -> bool:
    """Whether the lease's node recorded a restart (new incarnation) after ``since``. One query on
    the ``nodeevent_node_recent`` index."""
    return NodeEvent.objects.filter(
        node_id=lease.node_id, type=fleet_event_types.RESTART, created_at__gt=since
    ).exists()


def count_lease_outcome(sender, *, lease, now, **kwargs) -> None:
    """``leases.signals.lease_ended`` receiver: count ``lease`` in its node's reliability record,
    in the transaction that ended it (a rollback takes the count back too)."""
    node = Node.objects.filter(pk=lease.node_id).values("liveness", "lifecycle").first()
    if node is None:
        return
    outcome = classify(lease, node=node, now=now)
    if outcome is not None:
        record_lease_outcome(node_id=lease.node_id, outcome=outcome, at=now)


# --- the request ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeConstraint:
    """``<attribute> <operator> <value>`` on a node attribute (only ``reliability`` so far)."""

    attribute: str
    comparison: Comparison

    @property
    def value(self) -> float:
        return float(self.comparison.value)

    def holds(self, actual) -> bool:
        return self.comparison.holds(actual)

    def q(self, prefix: str = "", value: Any = None) -> Q:
        """The filter as SQL on ``<prefix><column>``; NULL (unrated) never passes. ``value``
        replaces the constraint's value (placement's compiled-query sentinels)."""
        column = prefix + NODE_ATTRIBUTES[self.attribute]
        number = self.value if value is None else value
        lookup = {"=": "exact", ">": "gt", ">=": "gte", "<": "lt", "<=": "lte"}.get(self.comparison.operator)
        if lookup is None:  # "!="
            return Q(**{f"{column}__isnull": False}) & ~Q(**{column: number})
        return Q(**{f"{column}__{lookup}": number})

    def __str__(self) -> str:
        return f"{self.attribute} {self.comparison.operator} {_number(self.comparison.value)}"


class NodeConstraintError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.code = field, message, INVALID_NODE_CONSTRAINT


def _number(value: Decimal) -> str:
    return format(value.normalize(), "f")


def parse_node_constraint(item: Any, name: str, *, extra: frozenset = frozenset()) -> NodeConstraint:
    """One ``{"attribute", "operator", "value"}``. ``value`` is a number (or a numeric string such as
    ``"0.99"``) in [0, 1]. Raises :class:`NodeConstraintError` naming the member."""
    allowed = {"attribute", "operator", "value"} | extra
    if not isinstance(item, dict) or set(item) - allowed:
        raise NodeConstraintError(name, f"must be an object with {', '.join(sorted(allowed))}")
    attribute = item.get("attribute")
    if not isinstance(attribute, str) or attribute not in NODE_ATTRIBUTES:  # a list is unhashable
        raise NodeConstraintError(f"{name}.attribute", f"must be one of {', '.join(NODE_ATTRIBUTES)}")
    try:
        comparison = Comparison.parse(item.get("operator"), item.get("value"))
    except ComparisonError as exc:
        member = "operator" if item.get("operator") not in NUMERIC_OPERATORS else "value"
        raise NodeConstraintError(f"{name}.{member}", str(exc)) from exc
    if not Decimal(0) <= comparison.value <= Decimal(1):
        raise NodeConstraintError(f"{name}.value", "reliability is a number from 0 to 1")
    return NodeConstraint(attribute, comparison)


def parse_node_constraints(raw: Any) -> tuple[NodeConstraint, ...]:
    """A request's ``node_constraints`` (None: none). Raises :class:`NodeConstraintError`."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_NODE_CONSTRAINTS:
        raise NodeConstraintError("node_constraints", f"must be a list of at most {MAX_NODE_CONSTRAINTS} constraints")
    return tuple(parse_node_constraint(item, f"node_constraints[{i}]") for i, item in enumerate(raw))


def parse_node_preferences(raw: Any) -> tuple[tuple[int, NodeConstraint], ...]:
    """A request's ``node_preferences``: ``[{"weight": 1-100, "attribute", "operator", "value"}]``
    (Kubernetes' preferred-term weights). Raises :class:`NodeConstraintError`."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_NODE_CONSTRAINTS:
        raise NodeConstraintError("node_preferences", f"must be a list of at most {MAX_NODE_CONSTRAINTS} preferences")
    out = []
    for i, item in enumerate(raw):
        name = f"node_preferences[{i}]"
        constraint = parse_node_constraint(item, name, extra=frozenset({"weight"}))
        weight = item.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise NodeConstraintError(f"{name}.weight", "must be an integer from 1 to 100 (Kubernetes' range)")
        out.append((weight, constraint))
    return tuple(out)


# --- placement hooks (leases.placement) -----------------------------------------------------------
def candidate_filter(constraints, prefix: str = "node__", values=None) -> Q:
    """Every constraint as one SQL condition on ``<prefix>reliability`` (``values``: sentinels in
    place of the constraints' values, for the compiled candidate query)."""
    condition = Q()
    for index, constraint in enumerate(constraints):
        condition &= constraint.q(prefix, None if values is None else values[index])
    return condition


def shape_key(constraints) -> tuple:
    """What the compiled candidate SQL depends on: attributes and operators, not values."""
    return tuple((c.attribute, c.comparison.operator) for c in constraints)


def sentinels(constraints) -> dict[str, float]:
    """Placeholder values (``{"nc:<i>": float}``) no real constraint holds (reliability is in [0, 1])."""
    return {f"nc:{i}": 7_340_201.25 + i for i in range(len(constraints))}


def census_reason(constraints):
    """For :func:`leases.placement.diagnose`'s group key: ``reliability_unrated`` for a node
    without a score, ``reliability_not_met`` for one whose score fails a constraint, else ''."""
    return Case(
        When(Q(reliability__isnull=True), then=Value(UNRATED)),
        When(~candidate_filter(constraints, prefix=""), then=Value(NOT_MET)),
        default=Value(""),
    )


def phrases(constraints) -> dict[str, str]:
    """The 409's "N node(s) …" phrase of each census code, as the request words it."""
    if not constraints:
        return {}
    if len(constraints) == 1 and constraints[0].comparison.operator in (">=", ">"):
        word = "below" if constraints[0].comparison.operator == ">=" else "at or below"
        not_met = f"node(s) had reliability {word} {_number(constraints[0].comparison.value)}"
    else:
        not_met = "node(s) did not have " + " and ".join(str(c) for c in constraints)
    minimum, days = fleet_conf.get("RELIABILITY_MIN_SAMPLE"), fleet_conf.get("RELIABILITY_WINDOW_DAYS")
    return {
        NOT_MET: not_met,
        UNRATED: f"node(s) had no reliability record yet (fewer than {minimum} counted leases in {days} days)",
    }


def preference_parts(candidates, preferences) -> dict:
    """``{node pk: {"reliability": 0-100}}``: the share of the preferences' weights each
    candidate meets (one query for all of them); ``{}`` without preferences."""
    if not preferences or not candidates:
        return {}
    scores = dict(Node.objects.filter(pk__in=[c.node.pk for c in candidates]).values_list("pk", "reliability"))
    total = sum(weight for weight, _ in preferences)
    return {
        pk: {"reliability": round(100 * sum(w for w, c in preferences if c.holds(value)) / total, 2)}
        for pk, value in scores.items()
    }
