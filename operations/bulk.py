"""Cordon, uncordon and drain many nodes by label selector (issue 33 item 9; asked of Nomad since
2016, nomad#1037), guarded against the accident of kubernetes#141422 (an empty selector evicted
everything):

- the selector must name something: an empty (or blank) selector is refused (400 ``empty_selector``);
- the caller says how many nodes it expects (``expected_count``); any other count is refused with
  the count found (409 ``bulk_count_mismatch``), so a selector that matches more than meant acts on none;
- at most ``NODEPOOL_BULK_MAX_NODES`` (100) nodes per call (422 ``bulk_too_many``);
- ``dry_run`` answers the same list, changing nothing;
- a drain goes node by node through the one disruption gate
  (:func:`operations.disruption.request_disruption`, reason ``maintenance``): the pool's disruption
  budgets and windows and the workloads' disruption budgets may refuse some nodes, which are
  reported as ``blocked`` with the blocker while the others drain.

The selector is the node list's (:func:`fleet.labelselector.filter_nodes`: all of Kubernetes'
grammar, on the labels placement matches). Each node is acted on in its own transaction: one node's
refusal (a 409 for a retired node, a blocked drain) does not undo another's action. Two bulk drains
at once stay within the budgets: the gate locks the pool's settings row while it counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from fleet.errors import POOL_NOT_FOUND
from fleet.events import Actor
from fleet.labelselector import SelectorError, filter_nodes
from fleet.models import Node, Pool
from maintenance import drains, holds
from nodepool.api.errors import INVALID_FILTER
from nodepool.api.problems import Conflict, NotFound, Problem, Unprocessable

from . import conf, disruption
from .choices import DisruptionReason
from .errors import BULK_COUNT_MISMATCH, BULK_TOO_MANY, EMPTY_SELECTOR

ACTIONS = ("cordon", "uncordon", "drain")


@dataclass
class Outcome:
    node: Node
    outcome: str  # "cordoned" | "uncordoned" | "draining" | "blocked" | "failed" | "would_<action>"
    detail: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        node = self.node
        return {"node_id": str(node.pk), "name": node.hostname, "pool": node.pool.name, "lifecycle": node.lifecycle,
                "outcome": self.outcome, "detail": self.detail, **self.extra}  # fmt: skip


def select_nodes(selector: str, *, pool: str | None = None) -> list[Node]:
    """The nodes ``selector`` (and ``pool``, when given) picks, by name; not the retired.

    Raises:
        Problem: 400 ``empty_selector`` (blank selector), 400 ``invalid_filter`` (malformed, as the
            node list answers it); NotFound (404 ``pool_not_found``) for an unknown pool.
    """
    if not isinstance(selector, str) or not selector.strip():
        raise Problem("A bulk action needs a non-empty label selector: it would act on every node.", EMPTY_SELECTOR)
    nodes = Node.objects.select_related("pool").exclude(lifecycle="retired")
    if pool is not None:
        if not Pool.objects.filter(name=pool).exists():
            raise NotFound(f"No pool named {pool!r}.", POOL_NOT_FOUND)
        nodes = nodes.filter(pool__name=pool)
    try:
        nodes = filter_nodes(nodes, [selector])
    except SelectorError as exc:
        raise Problem(f"label selector {selector[:200]!r}: {exc}", INVALID_FILTER) from exc
    return list(nodes.order_by("hostname", "pk"))


def check_count(nodes: list[Node], expected_count: int) -> None:
    """Raises: Unprocessable (422 ``bulk_too_many``) above the limit; Conflict (409
    ``bulk_count_mismatch``) when ``expected_count`` is not the number matched."""
    limit = conf.get("BULK_MAX_NODES")
    if len(nodes) > limit:
        raise Unprocessable(
            f"The selector matches {len(nodes)} nodes; a bulk action takes at most {limit}: narrow it (or use --pool).",
            BULK_TOO_MANY,
            matched=len(nodes),
            limit=limit,
        )
    if len(nodes) != expected_count:
        raise Conflict(
            f"The selector matches {len(nodes)} node(s), not the {expected_count} expected; nothing was done.",
            BULK_COUNT_MISMATCH,
            matched=len(nodes),
            expected_count=expected_count,
            nodes=[n.hostname or str(n.pk) for n in nodes[:limit]],
        )


def run(
    action: str,
    nodes: list[Node],
    *,
    actor: Actor,
    reason: str,
    dry_run: bool = False,
    policy: str = "wait",
    deadline: datetime | None = None,
    now=None,
) -> list[Outcome]:
    """``action`` on each node in its own transaction (see the module doc); the outcomes in order."""
    now = now or timezone.now()
    owner = holds.owner_for(actor)
    outcomes = []
    for node in nodes:
        if dry_run:
            outcomes.append(_plan(action, node, owner=owner, now=now))
            continue
        try:
            outcomes.append(_act(action, node, actor=actor, owner=owner, reason=reason, policy=policy,
                                 deadline=deadline, now=now))  # fmt: skip
        except disruption.DisruptionBlocked as blocked:
            blocked.record()
            outcomes.append(Outcome(node, "blocked", blocked.verdict.describe(), {"blocker": blocked.verdict.blocker}))
        except Problem as exc:
            outcomes.append(Outcome(node, "failed", str(exc.detail), {"code": getattr(exc.detail, "code", "")}))
        node.refresh_from_db(fields=["lifecycle"])
    return outcomes


def _plan(action: str, node: Node, *, owner: str, now) -> Outcome:
    if action != "drain":
        return Outcome(node, f"would_{action}")
    with transaction.atomic():
        verdict = disruption.request_disruption(
            node=node, reason=DisruptionReason.MAINTENANCE, owner=owner, now=now, record=False
        )
    if not verdict.allowed:
        return Outcome(node, "blocked", verdict.describe(), {"blocker": verdict.blocker})
    return Outcome(node, "would_drain")


def _act(action: str, node: Node, *, actor: Actor, owner: str, reason: str, policy: str, deadline, now) -> Outcome:
    if action == "cordon":
        holds.place_hold(node.pk, owner, reason, actor=actor, now=now)
        return Outcome(node, "cordoned")
    if action == "uncordon":
        try:
            holds.remove_hold(node.pk, owner, actor=actor, reason=reason, now=now)
        except Conflict as exc:  # 409 hold_not_found: nothing of the caller's to remove
            return Outcome(node, "unchanged", str(exc.detail), {"code": getattr(exc.detail, "code", "")})
        still = Node.objects.filter(pk=node.pk).values_list("cordoned", flat=True).get()
        return Outcome(node, "uncordoned" if not still else "still_cordoned")
    with transaction.atomic():
        verdict = disruption.request_disruption(
            node=node, reason=DisruptionReason.MAINTENANCE, owner=owner, now=now, record=False
        )
        if not verdict.allowed:
            raise disruption.DisruptionBlocked(verdict, node=node, owner=owner, now=now)
        version = Node.objects.filter(pk=node.pk).values_list("version", flat=True).get()
        drain = drains.start_drain(node_id=node.pk, expected_version=version, policy=policy, deadline=deadline,
                                   reason=reason, actor=actor, now=now)  # fmt: skip
        disruption.clear_blocked(node)
    return Outcome(node, "draining", "", {"drain_id": str(drain.pk)})
