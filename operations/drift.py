"""Drift: a node that no longer has the shape its pool gives nodes now (issue #34 item 3).

**The pool's node-shaping part** (:func:`pool_shape`) is what makes a node of the pool what it is:

- the target versions the agent reports or declares — ``version`` and ``agent_versions``,
  ``image`` (or OS), ``kernel``, ``driver`` and the target's ``labels`` (:mod:`operations.targets`);
- the labels, taints and reservations the control plane applies at admission (``Pool.labels``,
  ``Pool.taints``, ``Pool.reservations``).

Fields that do not change a node are left out, as Karpenter leaves them out of its NodePool hash
(``karpenter.sh/nodepool-hash``): disruption budgets, limits, every autoscaling setting, drain
settings, the node template's resources (a provider's concern), and the target's ``artifact`` and
``action`` (how a node gets to a version, not what it runs).

**The hash** (:func:`shape_hash`) is ``sha256`` of the shape's canonical JSON: keys sorted, no
whitespace (``separators=(",", ":")``), UTF-8 without escaping, taints sorted by ``(key, value,
effect)`` (their order does not change a node), empty members left out. ``HASH_VERSION`` names
this recipe: when it changes, nodes recorded with another version get the new hash without being
called drifted (Karpenter's ``karpenter.sh/nodepool-hash-version`` does the same).

**Recording.** The admission check ``pool_shape`` (always passes; pure) stores the hash in its
``AdmissionCheck.data`` at each admission, so a node records the hash it was admitted with, and an
upgrade (which re-admits every node it moves) records the new one. The sweep copies it into the
node's :class:`~operations.models.NodeShape`. Nodes admitted before drift existed get their pool's
current hash at the **first sweep**, not through the migration: a migration would need the hash
recipe frozen into it, and calling every existing node drifted on deploy would replace the whole
fleet for a change nobody made (the reported versions still count: a node off its target is
drifted from the first sweep).

**Drifted** = the recorded hash differs from the pool's, or the node's reported versions miss the
target (:func:`operations.targets.target_mismatches`). The node then carries the server-owned
condition ``Drifted=True`` (reason ``PoolShapeChanged`` or ``VersionMismatch``) and is replaced
under the budgets (:mod:`operations.replacement`), except while an upgrade of the pool is active:
the upgrade set the target and owns the roll.
"""

from __future__ import annotations

import hashlib
import json

from django.db.models import F
from django.utils import timezone

from fleet.admission import Outcome, passed
from fleet.choices import CheckStatus, Lifecycle
from fleet.models import AdmissionCheck, Node, Pool

from .models import NodeShape, PoolOperations
from .targets import target_mismatches

CHECK_NAME = "pool_shape"
HASH_VERSION = "v1"
CONDITION = "Drifted"
TARGET_MEMBERS = ("version", "agent_versions", "image", "kernel", "driver", "labels")
# Nodes whose shape is followed: admitted at least once and not gone.
FOLLOWED = (Lifecycle.READY, Lifecycle.DRAINING, Lifecycle.MAINTENANCE)


def pool_shape(pool: Pool, target: dict | None) -> dict:
    """The node-shaping part of ``pool`` with its ``target`` (the module doc says what is in and
    out): ``{"target": {version, agent_versions, image, kernel, driver, labels}, "labels": {},
    "taints": [{key, value, effect}], "reservations": {class: {resource: canonical int}}}``, empty
    members left out."""
    target = target or {}
    shape = {
        "target": {name: target[name] for name in TARGET_MEMBERS if target.get(name)},
        "labels": dict(pool.labels or {}),
        "taints": sorted(
            (
                {"key": t.get("key", ""), "value": t.get("value", ""), "effect": t.get("effect", "")}
                for t in pool.taints or []
            ),
            key=lambda t: (t["key"], t["value"], t["effect"]),
        ),
        "reservations": dict(pool.reservations or {}),
    }
    return {name: value for name, value in shape.items() if value}


def canonical_json(value) -> bytes:
    """Keys sorted, no whitespace, UTF-8 unescaped: the same object always gives the same bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def shape_hash(pool: Pool, target: dict | None = None) -> str:
    """``sha256`` (64 lowercase hex) of :func:`canonical_json` of :func:`pool_shape`."""
    return hashlib.sha256(canonical_json(pool_shape(pool, target))).hexdigest()


def current_hash(pool: Pool) -> str:
    """The hash of ``pool`` now (its target read from its operation settings)."""
    target = PoolOperations.objects.filter(pool=pool).values_list("target", flat=True).first()
    return shape_hash(pool, target)


def check_pool_shape(node: Node, pool: Pool) -> Outcome:
    """Admission check ``pool_shape``: always passes; records the hash the node is admitted with."""
    digest = current_hash(pool)
    return passed(f"admitted with pool shape {digest[:12]}", pool_hash=digest, hash_version=HASH_VERSION)


def record_shapes(pool: Pool, *, digest: str, now=None) -> int:
    """Bring the pool's :class:`NodeShape` rows up to date: a node admitted again since its row was
    written (its current attempt's ``pool_shape`` check passed) takes that check's hash and time;
    a followed node without a row gets ``digest`` (the pool's hash now: the first sweep) and its
    enrolment time. Returns rows written."""
    now = now or timezone.now()
    written = 0
    nodes = Node.objects.filter(pool=pool, lifecycle__in=FOLLOWED)
    known = dict(NodeShape.objects.filter(node__in=nodes).values_list("node_id", "admission_attempt"))
    checks = AdmissionCheck.objects.filter(
        node__in=nodes, name=CHECK_NAME, status=CheckStatus.PASSED, attempt=F("node__admission_attempt")
    ).values_list("node_id", "attempt", "data", "finished_at")
    for node_id, attempt, data, finished_at in checks:
        if node_id in known and known[node_id] >= attempt:
            continue
        NodeShape.objects.update_or_create(
            node_id=node_id,
            defaults={
                "pool": pool,
                "pool_hash": (data or {}).get("pool_hash", digest),
                "hash_version": (data or {}).get("hash_version", HASH_VERSION),
                "admission_attempt": attempt,
                "admitted_at": finished_at or now,
            },
        )
        known[node_id] = attempt
        written += 1
    for node_id, attempt, enrolled_at, created_at in nodes.exclude(pk__in=list(known)).values_list(
        "pk", "admission_attempt", "enrolled_at", "created_at"
    ):
        _, created = NodeShape.objects.get_or_create(
            node_id=node_id,
            defaults={
                "pool": pool,
                "pool_hash": digest,
                "admission_attempt": attempt,
                "admitted_at": enrolled_at or created_at or now,
            },
        )
        written += created
    # A recipe of another version is re-recorded, not drifted (Karpenter's hash-version rule).
    written += (
        NodeShape.objects.filter(pool=pool)
        .exclude(hash_version=HASH_VERSION)
        .update(pool_hash=digest, hash_version=HASH_VERSION)
    )
    return written


def drift_reasons(node: Node, shape: NodeShape, *, digest: str, target: dict) -> list[str]:
    """Why ``node`` has drifted (empty: it has not): its recorded hash is not the pool's, or its
    reported versions miss the target."""
    reasons = []
    if shape.pool_hash != digest:
        reasons.append(f"pool shape changed (admitted with {shape.pool_hash[:12]}, pool now {digest[:12]})")
    if target:
        reasons.extend(target_mismatches(node, target))
    return reasons


def condition(reasons: list[str]) -> dict:
    """The server-owned ``Drifted`` condition for ``reasons`` (Kubernetes' NodeCondition shape)."""
    if not reasons:
        return {"type": CONDITION, "status": "False", "reason": "AtPoolShape", "message": ""}
    kind = "PoolShapeChanged" if reasons[0].startswith("pool shape changed") else "VersionMismatch"
    return {"type": CONDITION, "status": "True", "reason": kind, "message": "; ".join(reasons)[:500]}
