"""Marketplace admin, quarantines and appeals: the owner's page of their quarantined node (evidence
as they may read it, next steps, the appeal link), the appeals queue operators work, and the node
page's marketplace section (fleet.admin_sections)."""

from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from fleet.admin_sections import NodeSection, register_node_section
from fleet.events import Actor
from maintenance.admin import ReasonForm, Spec, run_with_form
from maintenance.models import Quarantine
from maintenance.selectors import public_evidence
from nodepool.api.permissions import is_operator, is_owner
from nodepool.api.problems import Problem

from . import appeals, selectors
from .admin_base import ReadOnlyForOwners, link
from .choices import AppealState
from .models import (
    Appeal,
    OwnedQuarantine,
    UsageRecord,
)


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
        return link("admin:marketplace_ownedquarantine_change", appeal.quarantine_id, appeal.quarantine.reason)


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
