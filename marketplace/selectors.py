"""Read-side queries of the marketplace: what each role may see, the owner's view of a quarantine,
and the retention guard (docs/marketplace.md)."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from maintenance.choices import QuarantineRule
from maintenance.models import Quarantine
from maintenance.selectors import public_evidence
from nodepool.api.permissions import is_operator, is_owner

from .choices import PAYABLE_STATES, StatementState
from .models import Appeal, QuarantineGuidance, Statement, UsageRecord

# What an owner can do next, per quarantine rule, until operators write their own (admin:
# Marketplace › Quarantine guidance). Said plainly: what happened, what to fix, how to come back.
DEFAULT_NEXT_STEPS = {
    QuarantineRule.MANUAL: "An operator quarantined this node. Read the reason and evidence; if you believe it is "
    "wrong, appeal with what you know. Once released, the node goes through admission again.",
    QuarantineRule.IMPOSSIBLE_USAGE: "The node reported using more than it has. Check the agent's inventory and "
    "the machine for tampering or a broken sensor, then appeal saying what you found and fixed.",
    QuarantineRule.AGENT_VERSION: "The agent's version is not allowed in this pool. Upgrade the agent to an allowed "
    "version, then appeal so an operator releases the node.",
    QuarantineRule.ATTESTATION_FAILED: "The node's attestation failed. Re-provision the machine from a trusted "
    "image, then appeal with the details.",
    QuarantineRule.INTEGRITY_FAILED: "An integrity check failed. Reinstall the agent and verify the machine, then "
    "appeal with what you found.",
    QuarantineRule.CAPACITY_ABOVE_VERIFIED: "The node declared far more capacity than was verified. Correct the "
    "declared capacity, then appeal so it can be benchmarked again.",
}


def usage_records_for(user) -> QuerySet[UsageRecord]:
    """Operators see every usage record; owners their own nodes' (others' answer 404); anyone else none."""
    qs = UsageRecord.objects.select_related("node", "pool", "lease", "owner")
    if is_operator(user):
        return qs
    return qs.filter(owner=user) if is_owner(user) else qs.none()


def statements_for(user) -> QuerySet[Statement]:
    qs = Statement.objects.select_related("owner")
    if is_operator(user):
        return qs
    return qs.filter(owner=user) if is_owner(user) else qs.none()


def appeals_for(user) -> QuerySet[Appeal]:
    qs = Appeal.objects.select_related("quarantine", "node", "owner")
    if is_operator(user):
        return qs
    return qs.filter(owner=user) if is_owner(user) else qs.none()


def next_steps(rule: str) -> str:
    """The operators' text for ``rule``, else the built-in default, else the manual one."""
    text = QuarantineGuidance.objects.filter(rule=rule).values_list("next_steps", flat=True).first()
    return text or DEFAULT_NEXT_STEPS.get(rule) or DEFAULT_NEXT_STEPS[QuarantineRule.MANUAL]


def quarantine_view(node, user) -> dict | None:
    """The latest quarantine of ``node`` as ``user`` may see it, or None when it never was one.

    ``{"id", "open", "rule", "rule_label", "reason", "created_at", "released_at", "release_reason",
    "evidence", "next_steps", "appeals": [...], "can_appeal"}``. Owners get the evidence without
    what operators marked private; operators get all of it.
    """
    quarantine = Quarantine.objects.filter(node=node).order_by("-created_at", "-id").first()
    if quarantine is None:
        return None
    operator = is_operator(user)
    appeals = list(Appeal.objects.filter(quarantine=quarantine).order_by("created_at", "id"))
    return {
        "id": quarantine.pk,
        "open": quarantine.released_at is None,
        "rule": quarantine.rule,
        "rule_label": QuarantineRule(quarantine.rule).label if quarantine.rule in QuarantineRule.values else "",
        "reason": quarantine.reason,
        "created_at": quarantine.created_at.isoformat(),
        "released_at": quarantine.released_at.isoformat() if quarantine.released_at else None,
        "release_reason": quarantine.release_reason,
        "evidence": quarantine.evidence if operator else public_evidence(quarantine.evidence),
        "next_steps": next_steps(quarantine.rule),
        "appeals": [appeal_dict(a) for a in appeals],
        "can_appeal": (
            not operator
            and quarantine.released_at is None
            and node.owner_id == user.pk
            and not any(a.state == "open" for a in appeals)
        ),
    }


def appeal_dict(appeal: Appeal) -> dict:
    return {
        "id": appeal.pk,
        "node": str(appeal.node_id),
        "quarantine": appeal.quarantine_id,
        "owner": appeal.owner.get_username(),
        "statement": appeal.statement,
        "state": appeal.state,
        "resolution": appeal.resolution,
        "resolved_by": appeal.resolved_by,
        "created_at": appeal.created_at.isoformat(),
        "resolved_at": appeal.resolved_at.isoformat() if appeal.resolved_at else None,
        "version": appeal.version,
    }


def unsettled_lease_ids():
    """Leases whose usage is not settled: reconciliation not payable yet (pending, held, disputed),
    or a line on a statement that is not final. Retention (nodepool.retention) keeps these leases,
    their evidence intervals, checkpoints and events (:func:`keep_unsettled_leases`)."""
    return UsageRecord.objects.filter(
        ~Q(state__in=PAYABLE_STATES)
        | Q(statement_line__statement__state=StatementState.OPEN)
        | Q(statement_line__isnull=True, owner__isnull=False)
    ).values_list("lease_id", flat=True)


def keep_unsettled_leases() -> Q:
    """nodepool.retention.keep_leases hook: never prune a lease whose usage is not settled."""
    return Q(pk__in=unsettled_lease_ids())


def keep_unsettled_lease_events() -> Q:
    """nodepool.retention.keep_events hook: never prune the events of such a lease."""
    return Q(lease_id__in=unsettled_lease_ids())


# Events of the money (payouts, holds, line appeals, pool periods, mismatch items): the record of
# who moved money and why, kept as long as the rows they describe (which are never deleted).
MONEY_SUBJECTS = ("payout", "payout_hold", "line_appeal", "pool_period", "mismatch_item", "statement")


def keep_money_events() -> Q:
    """nodepool.retention.keep_events hook: never prune the events of payouts and their kin."""
    return Q(subject_type__in=MONEY_SUBJECTS)
