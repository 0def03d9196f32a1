"""Marketplace admin: the owner's pages (usage, statements, leases on their nodes, their quarantined
nodes and appeals) and the operators' (prices, settlement windows, guidance, the appeals queue).

Owners see only their own rows and are offered only what they may do: read, export, appeal. Every
link on their pages leads to a page they can open. Operators act through the services, with the
version they read (the maintenance admin's intermediate form). Quarantines, appeals and the node
page's section: :mod:`marketplace.appeals_admin`; the money: :mod:`marketplace.money_admin`.
"""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from fleet.admin import OperatorOnlyAdmin, ReadOnlyInline
from fleet.events import Actor
from leases.models import EvidenceInterval, LeaseCheckpoint
from maintenance.admin import ReasonForm, Spec, run_with_form
from nodepool.api.permissions import is_operator, is_owner

from . import pricing, reconciliation, statements
from .admin_base import ReadOnlyForOwners, link
from .choices import LineAppealState, StatementState
from .models import (
    OwnedLease,
    OwnerSettings,
    PoolPrice,
    PoolSettlement,
    QuarantineGuidance,
    Statement,
    StatementLine,
    UsageRecord,
)


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
        return link("admin:marketplace_ownedlease_change", record.lease_id, record.lease_id)

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
        return link("admin:marketplace_lineappeal_change", appeal.pk, appeal.state)

    @admin.display(description="appeal")
    def appeal_for_owner(self, line):
        appeal = self._appeal(line)
        if appeal is not None:
            shown = link("admin:marketplace_lineappeal_change", appeal.pk, appeal.state)
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


# Quarantines and appeals, and the money's pages (pool periods, mismatch items, payouts, holds, line
# appeals), live in their own modules; importing them registers their pages.
from . import appeals_admin, money_admin  # noqa: E402, F401
