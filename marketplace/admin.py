"""Marketplace admin: the owner's pages (usage, statements, leases on their nodes, their quarantined
nodes and appeals) and the operators' (prices, settlement windows, guidance, the appeals queue).

Owners see only their own rows and are offered only what they may do: read, export, appeal. Every
link on their pages leads to a page they can open. Operators act through the services, with the
version they read (the maintenance admin's intermediate form).
"""

from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from fleet.admin import OperatorOnlyAdmin, ReadOnlyInline
from fleet.admin_sections import NodeSection, register_node_section
from fleet.events import Actor
from leases.models import EvidenceInterval, LeaseCheckpoint
from maintenance.admin import ReasonForm, Spec, run_with_form
from maintenance.models import Quarantine
from maintenance.selectors import public_evidence
from nodepool.api.permissions import is_operator, is_owner
from nodepool.api.problems import Problem

from . import appeals, pricing, reconciliation, selectors, statements
from .choices import AppealState, LineAppealState, StatementState
from .models import (
    Appeal,
    OwnedLease,
    OwnedQuarantine,
    OwnerSettings,
    PoolPrice,
    PoolSettlement,
    QuarantineGuidance,
    Statement,
    StatementLine,
    UsageRecord,
)


def _link(viewname: str, pk, label) -> str:
    return format_html('<a href="{}">{}</a>', reverse(viewname, args=[pk]), label)


class ReadOnlyForOwners(admin.ModelAdmin):
    """Operators and owners read; nobody adds, edits or deletes here (services do).

    ``owner_field`` is the lookup from a row to its owner (``"owner"``, or ``"node__owner"`` for rows
    an owner sees because they ran on the owner's node). Nodes and pools are shown as text, not
    links: owners cannot open the fleet's pages.
    """

    owner_field = "owner"

    def has_module_permission(self, request):
        return is_operator(request.user) or is_owner(request.user)

    def has_view_permission(self, request, obj=None):
        if is_operator(request.user):
            return True
        return is_owner(request.user) and (obj is None or self.owner_of(obj) == request.user.pk)

    def owner_of(self, obj):
        *path, owner = self.owner_field.split("__")
        for name in path:
            obj = getattr(obj, name)
        return getattr(obj, f"{owner}_id")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if is_operator(request.user):
            return qs
        return qs.filter(**{self.owner_field: request.user}) if is_owner(request.user) else qs.none()

    def get_actions(self, request):
        return super().get_actions(request) if is_operator(request.user) else {}

    def get_list_filter(self, request):
        return self.list_filter if is_operator(request.user) else [f for f in self.list_filter if f != "owner"]

    @admin.display(description="node")
    def node_text(self, obj):
        return str(obj.node)

    @admin.display(description="pool")
    def pool_text(self, obj):
        return obj.pool.name


# --- usage records --------------------------------------------------------------------------------
@admin.action(description="Reconcile selected usage records now")
def reconcile_now(modeladmin, request, queryset):
    actor = Actor.from_request(request)
    done = [reconciliation.reconcile_usage(r.pk, actor=actor, force=True) for r in queryset]
    modeladmin.message_user(request, f"Reconciled: {', '.join(sorted({r.state for r in done if r}))}.")


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyForOwners):
    list_display = ["__str__", "node", "pool", "state", "billable_seconds", "allocated_seconds", "ended_at"]
    list_filter = ["state", "pool", "owner"]
    search_fields = ["workload_id"]
    list_select_related = ["node", "pool"]
    actions = [reconcile_now]
    fields = [
        "lease_link",
        "node_text",
        "pool_text",
        "workload_id",
        "fencing_token",
        "resources",
        "started_at",
        "ended_at",
        "lease_state",
        "outcome",
        "state",
        "settle_after",
        "allocated_seconds",
        "evidenced_seconds",
        "billable_seconds",
        "gap_table",
        "findings",
        "adjustment",
        "reconciled_at",
        "version",
    ]
    readonly_fields = fields

    @admin.display(description="lease")
    def lease_link(self, record):
        return _link("admin:marketplace_ownedlease_change", record.lease_id, record.lease_id)

    @admin.display(description="gaps (not billable)")
    def gap_table(self, record):
        if not record.gaps:
            return "—"
        rows = ((g["start"], g["end"], g["seconds"], g["reason"]) for g in record.gaps)
        return format_html_join("", "<div>{} – {}: {} s ({})</div>", rows)


# --- statements -----------------------------------------------------------------------------------
class StatementLineInline(ReadOnlyInline):
    model = StatementLine
    fk_name = "statement"
    fields = [
        "usage_record",
        "state",
        "pool_name",
        "billable_seconds",
        "coverage",
        "quantities",
        "amount",
        "currency",
        "reason",
    ]

    def get_fields(self, request, obj=None):
        # Owners appeal their own lines here (docs/marketplace.md, "Line appeals"); operators read
        # the appeal's state and work it on the *Line appeals* page.
        owner = is_owner(request.user) and not is_operator(request.user)
        return [*self.fields, "appeal_for_owner" if owner else "appeal_state"]

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    @staticmethod
    def _appeal(line):
        return line.appeals.exclude(state=LineAppealState.WITHDRAWN).order_by("-created_at", "-id").first()

    @admin.display(description="appeal")
    def appeal_state(self, line):
        appeal = self._appeal(line)
        if appeal is None:
            return "—"
        return _link("admin:marketplace_lineappeal_change", appeal.pk, appeal.state)

    @admin.display(description="appeal")
    def appeal_for_owner(self, line):
        appeal = self._appeal(line)
        if appeal is not None:
            shown = _link("admin:marketplace_lineappeal_change", appeal.pk, appeal.state)
            if appeal.state != LineAppealState.OPEN:
                return shown
            withdraw = reverse("admin:marketplace_lineappeal_withdraw", args=[appeal.pk])
            return format_html('{} · <a href="{}">Withdraw the appeal</a>', shown, withdraw)
        if line.statement.state != StatementState.FINAL:
            return "—"
        return format_html(
            '<a href="{}">Appeal this line</a>', reverse("admin:marketplace_lineappeal_file", args=[line.pk])
        )


def _finalize_run(statement, version, actor, data):
    statements.finalize_statement(statement_id=statement.pk, expected_version=version, actor=actor)


@admin.action(description="Finalize selected statements…")
def finalize_statements(modeladmin, request, queryset):
    spec = Spec("Finalize statement", "marketplace.change_statement", ReasonForm, _finalize_run)
    return run_with_form(modeladmin, request, queryset, spec, lambda statement: statement.version)


@admin.register(Statement)
class StatementAdmin(ReadOnlyForOwners):
    list_display = ["__str__", "period_start", "period_end", "state", "totals_text", "finalized_at"]
    list_filter = ["state", "owner"]
    inlines = [StatementLineInline]
    actions = [finalize_statements]
    change_list_template = "admin/marketplace/statement/change_list.html"  # says when the first one appears

    def changelist_view(self, request, extra_context=None):
        extra_context = {"is_owner_view": not is_operator(request.user), **(extra_context or {})}
        return super().changelist_view(request, extra_context)

    fields = [
        "owner_text",
        "period",
        "period_start",
        "period_end",
        "state",
        "totals_text",
        "exports",
        "carried_out",
        "finalized_at",
        "finalized_by",
        "version",
    ]
    readonly_fields = fields

    @admin.display(description="owner")
    def owner_text(self, statement):
        return statement.owner.get_username()

    @admin.display(description="totals")
    def totals_text(self, statement):
        return ", ".join(f"{amount} {currency}" for currency, amount in statements.totals(statement).items()) or "—"

    @admin.display(description="export")
    def exports(self, statement):
        base = f"/api/v1/statements/{statement.pk}/export"
        return format_html('<a href="{}.csv">CSV</a> · <a href="{}.json">JSON</a>', base, base)


# --- leases on the owner's nodes ------------------------------------------------------------------
class EvidenceInline(ReadOnlyInline):
    model = EvidenceInterval
    fields = [
        "started_at",
        "last_seen_at",
        "closed_at",
        "close_reason",
        "node_incarnation",
        "status_reports",
        "renewals",
    ]
    verbose_name_plural = "evidence intervals"


class CheckpointInline(EvidenceInline):
    model = LeaseCheckpoint
    fields = ["state", "requested_at", "requested_by", "taken_at", "message"]
    verbose_name_plural = "checkpoint history"


@admin.register(OwnedLease)
class OwnedLeaseAdmin(ReadOnlyForOwners):
    owner_field = "node__owner"
    list_display = ["__str__", "node", "state", "granted_at", "ended_at"]
    list_filter = ["state"]
    list_select_related = ["node"]
    inlines = [EvidenceInline, CheckpointInline]
    # Not the client's: command, spec, client, idempotency key, request hash, placement decision.
    fields = [
        "workload_id",
        "fencing_token",
        "node_text",
        "node_incarnation",
        "pool_text",
        "state",
        "workload_state",
        "resources",
        "shape_version",
        "granted_at",
        "activated_at",
        "expires_at",
        "ended_at",
        "end_reason",
        "outcome",
    ]
    readonly_fields = fields


# --- quarantines and appeals ----------------------------------------------------------------------
@admin.register(OwnedQuarantine)
class OwnedQuarantineAdmin(ReadOnlyForOwners):
    owner_field = "node__owner"
    list_display = ["node", "rule", "reason", "created_at", "released_at"]
    list_select_related = ["node"]
    fields = [
        "node_text",
        "rule",
        "reason",
        "created_at",
        "released_at",
        "release_reason",
        "evidence_shown",
        "next_steps",
        "appeal_history",
        "appeal_link",
    ]
    readonly_fields = fields

    @admin.display(description="evidence")
    def evidence_shown(self, quarantine):
        # As the owner reads it (operators read the whole evidence on the maintenance quarantine page).
        shown = public_evidence(quarantine.evidence)
        return format_html("<pre>{}</pre>", json.dumps(shown, indent=2, sort_keys=True))

    @admin.display(description="what you can do next")
    def next_steps(self, quarantine):
        return selectors.next_steps(quarantine.rule)

    @admin.display(description="appeals")
    def appeal_history(self, quarantine):
        rows = [
            (a.created_at.strftime("%Y-%m-%d %H:%M"), a.state, a.statement, a.resolution or "—")
            for a in quarantine.appeals.order_by("created_at")
        ]
        if not rows:
            return "—"
        return format_html_join("", "<div>{}: <strong>{}</strong> — {} — answer: {}</div>", rows)

    @admin.display(description="appeal")
    def appeal_link(self, quarantine):
        if quarantine.released_at is not None or quarantine.appeals.filter(state=AppealState.OPEN).exists():
            return "—"
        url = reverse("admin:marketplace_appeal_add") + f"?quarantine={quarantine.pk}"
        return format_html('<a href="{}">Appeal this quarantine</a>', url)


class AppealForm(forms.ModelForm):
    class Meta:
        model = Appeal
        fields = ["quarantine", "statement"]


def _resolve(outcome):
    def run(appeal, version, actor, data):
        appeals.appeal_resolve(
            appeal_id=appeal.pk, outcome=outcome, resolution=data["reason"], expected_version=version, actor=actor
        )

    return run


@admin.action(description="Uphold selected appeals (the quarantine stands)…")
def uphold_appeals(modeladmin, request, queryset):
    spec = Spec("Uphold appeal", "marketplace.change_appeal", ReasonForm, _resolve(AppealState.UPHELD))
    return run_with_form(modeladmin, request, queryset, spec, lambda appeal: appeal.version)


@admin.action(description="Overturn selected appeals (release the node)…")
def overturn_appeals(modeladmin, request, queryset):
    spec = Spec("Overturn appeal", "marketplace.change_appeal", ReasonForm, _resolve(AppealState.OVERTURNED))
    return run_with_form(modeladmin, request, queryset, spec, lambda appeal: appeal.version)


@admin.register(Appeal)
class AppealAdmin(ReadOnlyForOwners):
    """Owners file appeals here (their open quarantines only); operators work the queue."""

    form = AppealForm
    list_display = ["__str__", "node", "owner", "case", "state", "created_at", "resolved_at"]
    list_filter = ["state", "owner"]
    list_select_related = ["node", "owner"]
    actions = [uphold_appeals, overturn_appeals]

    @admin.display(description="the owner's case")
    def case(self, appeal):
        return appeal.statement if len(appeal.statement) <= 120 else appeal.statement[:119] + "…"

    ordering = ["state", "created_at"]

    def has_add_permission(self, request):
        return is_owner(request.user) and not is_operator(request.user)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["quarantine", "statement"]
        return [
            "node_text",
            "quarantine_link",
            "statement",
            "state",
            "resolution",
            "resolved_by",
            "created_at",
            "resolved_at",
            "version",
        ]

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else self.get_fields(request, obj)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "quarantine":
            kwargs["queryset"] = Quarantine.objects.filter(node__owner=request.user, released_at__isnull=True)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_changeform_initial_data(self, request):
        return {"quarantine": request.GET.get("quarantine")}

    def save_model(self, request, obj, form, change):
        try:
            appeal = appeals.appeal_create(
                owner=request.user,
                node_id=form.cleaned_data["quarantine"].node_id,
                statement=form.cleaned_data["statement"],
                actor=Actor.from_request(request),
            )
        except Problem as exc:
            messages.error(request, str(exc.detail))
            raise
        obj.pk = appeal.pk
        obj._state.adding = False

    @admin.display(description="quarantine")
    def quarantine_link(self, appeal):
        return _link("admin:marketplace_ownedquarantine_change", appeal.quarantine_id, appeal.quarantine.reason)


# --- operators' settings -------------------------------------------------------------------------


@admin.register(PoolPrice)
class PoolPriceAdmin(OperatorOnlyAdmin):
    """Prices are versions: add a new one from its effective time; an old one is never edited."""

    list_display = ["pool", "resource", "unit_price", "currency", "effective_from", "created_by"]
    list_filter = ["pool", "resource"]
    fields = ["pool", "resource", "unit_price", "currency", "effective_from", "note"]

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        price = pricing.set_price(
            pool=obj.pool,
            resource=obj.resource,
            unit_price=obj.unit_price,
            currency=obj.currency,
            effective_from=obj.effective_from,
            user=request.user,
            note=obj.note,
        )
        obj.pk = price.pk
        obj._state.adding = False


@admin.register(PoolSettlement)
class PoolSettlementAdmin(OperatorOnlyAdmin):
    list_display = ["pool", "settlement_window", "effective_window"]

    @admin.display(description="effective window (s)")
    def effective_window(self, settlement):
        return reconciliation.settlement_window(settlement.pool)


@admin.register(OwnerSettings)
class OwnerSettingsAdmin(OperatorOnlyAdmin):
    list_display = ["owner", "statement_period"]


@admin.register(QuarantineGuidance)
class QuarantineGuidanceAdmin(OperatorOnlyAdmin):
    list_display = ["rule", "next_steps", "updated_by", "updated_at"]
    readonly_fields = ["updated_by", "updated_at"]

    def save_model(self, request, obj, form, change):
        obj.updated_by = request.user.get_username()
        super().save_model(request, obj, form, change)


# --- the node page's marketplace section (fleet.admin_sections: fleet never imports marketplace) -----
def _node_marketplace(request, node) -> dict | None:
    """For the node's owner (and operators): the latest quarantine as the owner sees it — reason,
    public evidence, next steps, appeals, the appeal link — and links to the node's usage and leases."""
    if not (is_operator(request.user) or node.owner_id == request.user.pk):
        return None
    view = selectors.quarantine_view(node, request.user)
    quarantine_url = reverse("admin:marketplace_ownedquarantine_change", args=[view["id"]]) if view is not None else ""
    appeal_url = ""
    if view is not None and view["can_appeal"]:
        appeal_url = reverse("admin:marketplace_appeal_add") + f"?quarantine={view['id']}"
    return {
        "quarantine": view,
        "evidence": sorted(public_evidence(view["evidence"]).items()) if view else [],
        "quarantine_url": quarantine_url,
        "appeal_url": appeal_url,
        "usage_url": reverse("admin:marketplace_usagerecord_changelist") + f"?node__id__exact={node.pk}",
        "leases_url": reverse("admin:marketplace_ownedlease_changelist") + f"?node__id__exact={node.pk}",
        "usage_count": UsageRecord.objects.filter(node=node).count(),
    }


register_node_section(
    NodeSection(
        "marketplace",
        "Marketplace: quarantine, usage, appeals",
        58,
        "admin/marketplace/node_marketplace.html",
        _node_marketplace,
    )
)

# The money's pages (pool periods, mismatch items, payouts, holds, line appeals) live in their own module.
from . import money_admin  # noqa: E402, F401
