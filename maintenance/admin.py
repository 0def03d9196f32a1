"""Admin: node maintenance actions (each with an intermediate form for its reason), drains, budgets, quarantines.

The node actions are added to the fleet app's ``NodeAdmin`` when it is registered (fleet comes
first in INSTALLED_APPS); otherwise a small Node admin is registered here to carry them. Each
action shows a form first, with the versions of the selected nodes as read at that moment, so an
operator acting on a stale page gets "changed since you read it" rather than overwriting.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.template.response import TemplateResponse
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Node
from nodepool.admin_mixins import ReadOnlyRecordAdminMixin
from nodepool.api.problems import Problem

from . import drains, progress, services
from .choices import EvictionPolicy
from .models import DisruptionBudget, Drain, Eviction, Quarantine


class ReasonForm(forms.Form):
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 60}), max_length=2000)


DEADLINE_UNITS = {"minutes": 60, "hours": 3600, "days": 86400}


class DeadlineFields(forms.Form):
    """A deadline given relatively ("in 2 hours") or as a date and time (the browser's picker)."""

    deadline_in = forms.IntegerField(
        label="Deadline in", required=False, min_value=1, widget=forms.NumberInput(attrs={"style": "width: 6em"})
    )
    deadline_unit = forms.ChoiceField(
        label="unit", choices=[(u, u) for u in DEADLINE_UNITS], initial="hours", required=False
    )
    deadline = forms.DateTimeField(
        label="or at (UTC)",
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        help_text="Give either a relative deadline or a date and time.",
    )

    def clean(self):
        data = super().clean()
        relative, absolute = data.get("deadline_in"), data.get("deadline")
        if (relative is None) == (absolute is None):
            if not self.errors:
                raise forms.ValidationError("Give a deadline: either “in N minutes/hours/days” or a date and time.")
            return data
        if relative is not None:
            seconds = relative * DEADLINE_UNITS.get(data.get("deadline_unit") or "hours", 3600)
            data["deadline"] = timezone.now() + timedelta(seconds=seconds)
        return data


DEFAULT_DRAIN_DEADLINE_HOURS = 1  # Nomad's `nomad node drain -deadline` default (1h)


class DrainForm(ReasonForm, DeadlineFields):
    """A drain's policy, deadline (one hour from now unless changed) and reason."""

    policy = forms.ChoiceField(choices=EvictionPolicy.choices, initial=EvictionPolicy.WAIT)
    deadline_in = forms.IntegerField(
        label="Deadline in",
        required=False,
        min_value=1,
        initial=DEFAULT_DRAIN_DEADLINE_HOURS,
        widget=forms.NumberInput(attrs={"style": "width: 6em"}),
    )
    field_order = ["policy", "deadline_in", "deadline_unit", "deadline", "reason"]


class QuarantineForm(ReasonForm):
    evidence = forms.JSONField(required=False, initial=dict, help_text="JSON object: what was observed")

    def clean_evidence(self):
        value = self.cleaned_data.get("evidence") or {}
        if not isinstance(value, dict):
            raise forms.ValidationError("Evidence must be a JSON object.")
        return value


class CordonForm(ReasonForm):
    expires_at = forms.DateTimeField(required=False, help_text="optional, UTC: the hold ends by itself then")


class UncordonForm(ReasonForm):
    owner = forms.CharField(required=False, max_length=200, help_text="whose hold, e.g. user:olivia (empty: your own)")
    force = forms.BooleanField(
        required=False, help_text="operators only: remove that owner's hold (or, with no owner, every hold); recorded"
    )

    def clean_owner(self):
        return self.cleaned_data.get("owner") or None


class RetireForm(ReasonForm):
    force = forms.BooleanField(required=False, help_text="revoke live leases instead of refusing")


@dataclass(frozen=True)
class Spec:
    label: str  # the form's title and its primary button; messages start with it ("Drain done for …")
    permission: str
    form: type[forms.Form]
    run: Any  # (obj, version, actor, cleaned_data) -> None
    preview: Any = None  # (obj, version, cleaned_data) -> dict: a dry run shown before confirming
    description: str = ""  # the bulk action's entry in the node list's menu, for a person


def run_with_form(modeladmin, request, queryset, spec: Spec, version_of, *, back: str = ""):
    """Render the intermediate form, or (on ``apply``) run ``spec`` for each selected object.

    ``back``: where Cancel leads (default: the node page the action came from, else the list).
    Returns the form's response, or None once applied (the caller redirects).
    """
    if not request.user.has_perm(spec.permission):
        modeladmin.message_user(request, f"{spec.label} needs the {spec.permission} permission.", messages.ERROR)
        return None
    previews = []
    if "apply" in request.POST or "preview" in request.POST:
        form = spec.form(request.POST)
        if form.is_valid() and "preview" in request.POST and spec.preview is not None:
            previews = [(obj, _preview(spec, obj, request, form.cleaned_data)) for obj in queryset]
        elif form.is_valid():
            _apply(modeladmin, request, queryset, spec, form.cleaned_data)
            return None
    else:
        form = spec.form()
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": spec.label,
        "form": form,
        "objects": [(obj, version_of(obj)) for obj in queryset],
        "previews": previews,
        "can_preview": spec.preview is not None,
        "node_page": request.POST.get("_node_page", ""),
        "back": back or request.POST.get("_node_page", ""),
        "action": request.POST.get("action", ""),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "opts": modeladmin.model._meta,
    }
    return TemplateResponse(request, "admin/maintenance/action_form.html", context)


def _apply(modeladmin, request, queryset, spec: Spec, data: dict) -> None:
    """Run ``spec`` on each object at the version the operator read; one message per refusal.

    Messages name objects as they are written (a hostname keeps its case).
    """
    actor = Actor.from_request(request)
    done = []
    for obj in queryset:
        raw = request.POST.get(f"version_{obj.pk}", "")
        if not _is_version(raw):
            modeladmin.message_user(request, f"{spec.label} not done for {obj}: no version was read; try again.",
                                    messages.ERROR)  # fmt: skip
            continue
        try:
            spec.run(obj, int(raw), actor, data)
        except Problem as exc:
            modeladmin.message_user(request, f"{spec.label} refused for {obj}: {exc.detail}", messages.ERROR)
            continue
        done.append(str(obj))
    if done:
        modeladmin.message_user(request, f"{spec.label} done for {', '.join(done)}.", messages.SUCCESS)


def _is_version(raw: str) -> bool:
    """A posted ``version_<pk>``: ASCII digits only ("²".isdigit() is True, and int("²") raises)."""
    return raw.isascii() and raw.isdigit()


def _preview(spec: Spec, obj, request, data: dict) -> dict:
    raw = request.POST.get(f"version_{obj.pk}", "")
    if raw and not _is_version(raw):
        return {"problem": "no version was read; try again."}
    try:
        return {"plan": spec.preview(obj, int(raw) if raw else None, data)}
    except Problem as exc:
        return {"problem": exc.detail}


def _node_action(name: str, spec: Spec):
    def action(modeladmin, request, queryset):
        return run_with_form(modeladmin, request, queryset, spec, lambda node: node.version)

    action.__name__ = name
    return admin.action(description=spec.description or f"{spec.label} the selected nodes…")(action)


def _drain_run(node, version, actor, data):
    drains.start_drain(
        node_id=node.pk,
        expected_version=version,
        policy=data["policy"],
        deadline=data["deadline"],
        reason=data["reason"],
        actor=actor,
    )


def _drain_preview(node, version, data):
    return progress.plan_drain(
        node_id=node.pk, policy=data["policy"], deadline=data["deadline"], expected_version=version
    )


def _simple(service):
    def run(node, version, actor, data):
        service(node_id=node.pk, expected_version=version, actor=actor, **data)

    return run


def _release_run(node, version, actor, data):
    services.release_node(node_id=node.pk, expected_version=version, actor=actor, reason=data["reason"])


OPERATE = "fleet.operate_node"
DRAIN = Spec("Drain", OPERATE, DrainForm, _drain_run, _drain_preview, "Drain the selected nodes…")
# What a person reads in the node list's action menu (issue 33 item 6): a sentence, not a code name.
REPAIR_DRAIN = Spec(
    "Finish a lost drain",
    OPERATE,
    ReasonForm,
    _simple(drains.repair_stuck_drain),
    description="Finish a lost drain: a node left draining with no drain goes back to ready, cordoned by you…",
)
NODE_ACTIONS = [
    _node_action("cordon_nodes", Spec("Cordon (your own hold)", OPERATE, CordonForm, _simple(services.cordon_node),
                                      description="Cordon the selected nodes (your own hold)…")),
    _node_action("uncordon_nodes", Spec("Uncordon (your own hold)", OPERATE, UncordonForm,
                                        _simple(services.uncordon_node),
                                        description="Uncordon the selected nodes (your own hold)…")),
    _node_action("drain_nodes", DRAIN),
    _node_action("quarantine_nodes", Spec("Quarantine", "fleet.quarantine_node", QuarantineForm,
                                          _simple(services.quarantine_node))),
    _node_action("release_nodes", Spec("Release", "fleet.release_node", ReasonForm, _release_run,
                                       description="Release the selected nodes from quarantine…")),
    _node_action("return_nodes_to_service", Spec("Return to service", OPERATE, ReasonForm,
                                                 _simple(services.return_node_to_service),
                                                 description="Return the selected nodes to service…")),
    _node_action("retire_nodes", Spec("Retire", OPERATE, RetireForm, _simple(services.retire_node))),
    _node_action("repair_stuck_drains", REPAIR_DRAIN),
]  # fmt: skip


class MaintenanceNodeAdmin(admin.ModelAdmin):
    """Stands in for the fleet app's NodeAdmin when that is not registered."""

    list_display = ["__str__", "pool", "lifecycle", "liveness", "artifacts_blocked", "version"]
    list_filter = ["lifecycle", "pool"]
    readonly_fields = ["lifecycle", "version"]
    actions = NODE_ACTIONS


if admin.site.is_registered(Node):
    _node_admin = admin.site._registry[Node]
    _node_admin.actions = [*(_node_admin.actions or []), *NODE_ACTIONS]
else:
    admin.site.register(Node, MaintenanceNodeAdmin)


class EvictionInline(ReadOnlyRecordAdminMixin, admin.TabularInline):
    model = Eviction
    extra = 0
    can_delete = False
    readonly_fields = ["lease", "workload_id", "group", "fencing_token", "kind", "created_at"]
    fields = readonly_fields

    def has_view_permission(self, request, obj=None):
        return True


def _cancel_run(drain, version, actor, data):
    drains.cancel_drain(drain_id=drain.pk, expected_version=version, reason=data["reason"], actor=actor)


class DeadlineForm(ReasonForm, DeadlineFields):
    field_order = ["deadline_in", "deadline_unit", "deadline", "reason"]


def _deadline_run(drain, version, actor, data):
    drains.change_drain_deadline(
        drain_id=drain.pk, expected_version=version, deadline=data["deadline"], reason=data["reason"], actor=actor
    )


@admin.action(description="Cancel selected drains (the drain's hold is removed)…")
def cancel_drains(modeladmin, request, queryset):
    spec = Spec("Cancel drain", OPERATE, ReasonForm, _cancel_run)
    return run_with_form(modeladmin, request, queryset, spec, lambda drain: drain.version)


@admin.action(description="Change the deadline of selected drains…")
def change_deadlines(modeladmin, request, queryset):
    spec = Spec("Change drain deadline", OPERATE, DeadlineForm, _deadline_run)
    return run_with_form(modeladmin, request, queryset, spec, lambda drain: drain.version)


@admin.register(Drain)
class DrainAdmin(ReadOnlyRecordAdminMixin, admin.ModelAdmin):
    """Read-only records; cancel and deadline change are actions (services keep the node in step)."""

    list_display = ["node", "state", "policy", "deadline", "leases_remaining", "requested_by_name", "created_at"]
    list_filter = ["state", "policy"]
    search_fields = ["node__hostname", "reason"]
    readonly_fields = [f.name for f in Drain._meta.fields]
    inlines = [EvictionInline]
    actions = [cancel_drains, change_deadlines]


@admin.register(DisruptionBudget)
class DisruptionBudgetAdmin(admin.ModelAdmin):
    list_display = ["group", "max_unavailable", "min_available", "replacement_grace", "version"]
    search_fields = ["group"]
    readonly_fields = ["version", "created_by", "created_at", "updated_at"]

    def save_model(self, request, obj, form, change):
        if change:
            obj.version += 1
        elif obj.created_by_id is None:
            obj.created_by = request.user
        super().save_model(request, obj, form, change)


@admin.register(Quarantine)
class QuarantineAdmin(ReadOnlyRecordAdminMixin, admin.ModelAdmin):
    """Read-only records: quarantine is a node action (it revokes credentials and leases too)."""

    list_display = ["node", "rule", "created_at", "actor_name", "released_at"]
    list_filter = ["rule"]
    search_fields = ["node__hostname", "reason"]
    readonly_fields = [f.name for f in Quarantine._meta.fields]


from . import admin_node_page  # noqa: E402, F401  (registers maintenance's sections of the node page)
