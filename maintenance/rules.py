"""Automatic quarantine rules, evaluated by the control plane.

Each rule returns the :class:`~maintenance.choices.QuarantineRule` code that quarantined the node,
or None. The quarantine's reason names the rule and its evidence; an operator reverses it with
``release`` (the node then goes through a fresh admission). A node that is already quarantined
or retired is left alone.

Callers:
- the heartbeat service calls :func:`evaluate_heartbeat` on every applied heartbeat;
- fleet admission calls :func:`attestation_failed`, :func:`integrity_check_failed` and
  :func:`evaluate_declared_capacity`.
"""

from __future__ import annotations

from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.models import Node, NodeResource, Pool
from humanunits import quantity

from . import conf
from .choices import QuarantineRule
from .services import quarantine_node

_EXEMPT = (Lifecycle.QUARANTINED, Lifecycle.RETIRED)


def _quarantine(node: Node, rule: str, reason: str, evidence: dict[str, Any], actor: Actor) -> str:
    quarantine_node(node_id=node.pk, reason=reason, evidence={"rule": rule, **evidence}, actor=actor, rule=rule)
    # The caller holds this instance (e.g. inside its heartbeat transaction): bring it up to date so
    # its own later save sees the new lifecycle and version instead of failing as a concurrent change.
    node.reload()
    return rule


# Lifecycles before admission set the inventory: resources absent from it are not judged there.
_NO_INVENTORY_YET = (Lifecycle.PENDING, Lifecycle.ADMITTING, Lifecycle.REJECTED)


def _loaded_pool_field(node: Node, name: str):
    """A field of the node's pool if already in memory (no query), else None."""
    pool = node._state.fields_cache.get("pool")
    if pool is None or name in pool.get_deferred_fields():
        return None
    return getattr(pool, name)


def heartbeat_facts(node: Node, usage: dict[str, Any]) -> tuple[dict[str, int], str, list[str] | None]:
    """``({resource: capacity}, allowed_agent_versions, allowed_undeclared_resources or None)`` for
    the heartbeat rules, in one query.

    Every heartbeat pays for this, so the capacities of the reported resources and the pool's
    facts come back from a single indexed query (none at all when the usage is empty and the
    caller already loaded the pool). The allow-list is None when neither source had it; the
    impossible-usage rule loads it only if it needs it.
    """
    spec = _loaded_pool_field(node, "allowed_agent_versions")
    allowed = _loaded_pool_field(node, "allowed_undeclared_resources")
    capacities: dict[str, int] = {}
    if usage:
        rows = NodeResource.objects.filter(node_id=node.pk, name__in=list(usage)).values_list(
            "name", "capacity", "node__pool__allowed_agent_versions", "node__pool__allowed_undeclared_resources"
        )
        for name, capacity, row_spec, row_allowed in rows:
            capacities[name] = capacity
            spec = row_spec or "" if spec is None else spec
            allowed = list(row_allowed or []) if allowed is None else allowed
    if spec is None:
        spec = Pool.objects.filter(pk=node.pool_id).values_list("allowed_agent_versions", flat=True).first() or ""
    return capacities, spec, allowed


def impossible_usage(
    node: Node,
    usage: dict[str, Any],
    capacities: dict[str, int] | None = None,
    allowed_undeclared: list[str] | None = None,
) -> dict | None:
    """Evidence when ``usage`` exceeds the node's raw capacity beyond the tolerance, else None.

    A resource absent from the inventory has capacity 0: any use of it is impossible (a node
    without GPUs reporting ``nvidia.com/gpu: 4`` in use is exactly the misreport marketplace fraud
    controls look for), unless the pool lists it in ``allowed_undeclared_resources``. Absent
    resources are judged only once admission has set the node's inventory (not while it is
    ``pending``, ``admitting`` or ``rejected``). Tolerance is
    ``NODEPOOL["IMPOSSIBLE_USAGE_TOLERANCE"]`` (default 5 %, for measurement noise). The evidence
    names each resource: ``{"over_capacity": {name: {"usage", "capacity", "in_inventory"}}, ...}``.
    """
    if capacities is None:
        capacities = dict(NodeResource.objects.filter(node=node).values_list("name", "capacity"))
    judged = node.lifecycle not in _NO_INVENTORY_YET
    tolerance = float(conf.get("IMPOSSIBLE_USAGE_TOLERANCE"))
    over = {}
    for name, amount in (usage or {}).items():
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            continue
        if name not in capacities:
            if judged and amount > 0:
                if allowed_undeclared is None:  # loaded only now: most heartbeats never need it
                    allowed_undeclared = list(
                        Pool.objects.filter(pk=node.pool_id)
                        .values_list("allowed_undeclared_resources", flat=True)
                        .first()
                        or []
                    )
                if name not in allowed_undeclared:
                    over[name] = {"usage": amount, "capacity": 0, "in_inventory": False}
            continue
        if amount > capacities[name] * (1 + tolerance):
            over[name] = {"usage": amount, "capacity": capacities[name], "in_inventory": True}
    return {"over_capacity": over, "tolerance": tolerance} if over else None


def agent_version_outside(node: Node, agent_version: str, spec_text: str | None = None) -> dict[str, Any] | None:
    """Evidence when ``agent_version`` is outside the pool's ``allowed_agent_versions`` (PEP 440).

    An empty specifier allows any version. Pre-releases are judged by their place in the order
    (``1.2.0rc1`` satisfies ``>=1.0,<2``); an unparseable version is outside any non-empty set.
    A malformed pool specifier quarantines nobody (the pool's admin is at fault, not the node).
    """
    if spec_text is None:
        spec_text = node.pool.allowed_agent_versions
    spec_text = (spec_text or "").strip()
    if not spec_text:
        return None
    try:
        spec = SpecifierSet(spec_text)
    except InvalidSpecifier:
        return None
    try:
        version = Version(agent_version)
    except InvalidVersion:
        return {"agent_version": agent_version, "allowed": spec_text, "problem": "not a PEP 440 version"}
    if spec.contains(version, prereleases=True):
        return None
    return {"agent_version": agent_version, "allowed": spec_text}


def evaluate_heartbeat(node, *, usage: dict, agent_version: str, actor) -> str | None:
    """Check an applied heartbeat against the automatic quarantine rules.

    Args:
        node: the fleet.Node (saved, inside the heartbeat's transaction); refreshed in place when
            quarantined, so the caller sees lifecycle ``quarantined``.
        usage: ``{resource: canonical int}`` the node reported.
        agent_version: the agent version in the heartbeat.
        actor: fleet.events.Actor (the node, or the heartbeat service).

    Returns:
        ``"impossible_usage"`` or ``"agent_version_not_allowed"`` when the node was quarantined, else None.
    """
    if node.lifecycle in _EXEMPT:
        return None
    capacities, spec, allowed_undeclared = heartbeat_facts(node, usage)
    evidence = impossible_usage(node, usage, capacities, allowed_undeclared)
    if evidence:
        names = ", ".join(
            f"{name} {item['usage']} > capacity {item['capacity']}"
            + ("" if item["in_inventory"] else " (not in the inventory)")
            for name, item in evidence["over_capacity"].items()
        )
        return _quarantine(
            node,
            QuarantineRule.IMPOSSIBLE_USAGE,
            f"impossible_usage: reported usage above capacity ({names})",
            {"usage": usage, **evidence},
            actor,
        )
    evidence = agent_version_outside(node, agent_version, spec)
    if evidence:
        return _quarantine(
            node,
            QuarantineRule.AGENT_VERSION,
            f"agent_version_not_allowed: agent {agent_version!r} is outside the pool's allowed set "
            f"{evidence['allowed']!r}",
            evidence,
            actor,
        )
    return None


def device_identity_conflict(node, *, conflicts: list[dict], actor) -> str | None:
    """Quarantine ``node``, the later claimant of device ids another live node holds.

    Never the first holder (fleet.devices defines the handover that is not a conflict): otherwise
    anyone could get a victim quarantined by reporting its GPU UUIDs. ``conflicts`` is
    ``[{"device_id", "held_by", "type"}]``, kept as the evidence the owner sees.
    """
    if node.lifecycle in _EXEMPT or not conflicts:
        return None
    ids = ", ".join(c["device_id"] for c in conflicts[:5])
    return _quarantine(
        node,
        QuarantineRule.DEVICE_IDENTITY_CONFLICT,
        f"device_identity_conflict: {len(conflicts)} device id(s) already held by another live node ({ids})",
        {"conflicts": conflicts[:32]},
        actor,
    )


def attestation_failed(node, *, detail: str, evidence: dict | None = None, actor) -> str | None:
    """Quarantine ``node`` because its attestation did not verify (called by fleet admission).

    ``detail`` says what failed (bad signature, unknown key, nonce mismatch). Returns the rule code.
    """
    if node.lifecycle in _EXEMPT:
        return None
    return _quarantine(
        node,
        QuarantineRule.ATTESTATION_FAILED,
        f"attestation_failed: {detail}",
        {"detail": detail, **(evidence or {})},
        actor,
    )


def integrity_check_failed(node, *, check: str, detail: str, evidence: dict | None = None, actor) -> str | None:
    """Quarantine ``node`` because an integrity check (``check``, e.g. ``benchmark_nonce``) failed."""
    if node.lifecycle in _EXEMPT:
        return None
    return _quarantine(
        node,
        QuarantineRule.INTEGRITY_FAILED,
        f"integrity_check_failed: {check}: {detail}",
        {"check": check, "detail": detail, **(evidence or {})},
        actor,
    )


def evaluate_declared_capacity(
    node, *, declared: dict | None = None, verified: dict | None = None, actor, factor: float | None = None
) -> str | None:
    """Quarantine ``node`` when its declared capacity is far above what admission verified.

    Args:
        declared: ``{resource: canonical int}``; default ``node.declared["resources"]``.
        verified: ``{resource: canonical int}``; default ``node.verified["resources"]``. Devices
            pass their live and verified counts per type (fleet.signals.devices_above_verified).
        factor: "far above" threshold; default ``NODEPOOL["CAPACITY_ABOVE_VERIFIED_FACTOR"]`` (1.5).
            Resources absent from ``node.verified["resources"]`` are not judged.

    Returns: ``"capacity_above_verified"`` when quarantined, else None.
    """
    if node.lifecycle in _EXEMPT:
        return None
    factor = float(factor if factor is not None else conf.get("CAPACITY_ABOVE_VERIFIED_FACTOR"))
    declared = declared if declared is not None else (node.declared or {}).get("resources", {})
    verified = verified if verified is not None else (node.verified or {}).get("resources", {})
    over = {
        name: {"declared": amount, "verified": verified[name]}
        for name, amount in (declared or {}).items()
        if name in verified and isinstance(amount, int | float) and amount > verified[name] * factor
    }
    if not over:
        return None
    names = ", ".join(
        f"{name} {quantity(name, item['declared'])} > {factor} x verified {quantity(name, item['verified'])}"
        for name, item in over.items()
    )
    return _quarantine(
        node,
        QuarantineRule.CAPACITY_ABOVE_VERIFIED,
        f"capacity_above_verified: declared capacity far above verified ({names})",
        {"factor": factor, "over": over},
        actor,
    )
