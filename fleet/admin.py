"""Fleet admin: nodes (with admission checks, inventory, credentials and events inline), devices
and re-verifications; the pool and bootstrap-token pages (secret shown once) and the
operator-only base class are in :mod:`fleet.admin_pools`, registered by the import below.
Operators manage; marketplace owners get a read-only view of their own nodes and nothing else.
Every change goes through :mod:`fleet.services`.
"""

from __future__ import annotations

import uuid

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.db.models import F, Prefetch
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme

from nodepool.api.permissions import is_operator, is_owner
from nodepool.api.problems import Problem

from . import (
    admin_reliability,  # noqa: F401  (registers the node page's Reliability section)
    services,
)
from .admin_display import (
    OwnerFilter,
    SchedulableFilter,
    UnschedulableReasonFilter,
    annotate_free,
    free_cell,
    health_badge,
    liveness_cell,
    readiness_badge,
    schedulable_cell,
    short_id,
    state_badge,
)
from .admin_pools import OperatorOnlyAdmin
from .admin_sections import node_sections
from .devices import device_release, device_summary, device_verify, free_devices_text
from .events import Actor
from .filtersets import _label_filter
from .labelselector import NODE_DECLARED, PLACEMENT
from .models import AdmissionCheck, Device, Node, NodeCredential, NodeHold, Reverification
from .selectors import unschedulable_reasons, valid_credential_exists

RECENT_EVENTS_INLINE = 50


# --- nodes ------------------------------------------------------------------------------------------------------


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_view_permission(self, request, obj=None):
        return True

    def get_readonly_fields(self, request, obj=None):
        return self.fields


# What each admission check asks, for a person (fleet.admission's check names; a check another app
# registers reads as its name in words until it is added here).
CHECK_CAPTIONS = {
    "agent_version": "The agent's version is one the pool allows",
    "capabilities": "The declared resources meet the pool's requirements",
    "labels": "The labels the pool requires are present",
    "plausibility": "The declared resources are plausible for this hardware",
    "attestation": "A signed attestation from the pool's trusted key",
    "benchmark": "A benchmark confirms the declared cpu and memory",
    "upgrade_target": "The agent runs the pool's upgrade target version",
}


class AdmissionCheckInline(ReadOnlyInline):
    model = AdmissionCheck
    verbose_name = "admission check"
    fields = ["attempt", "check_caption", "status", "detail", "started_at", "finished_at"]
    ordering = ["-attempt", "id"]

    @admin.display(description="check")
    def check_caption(self, row: AdmissionCheck) -> str:
        return CHECK_CAPTIONS.get(row.name, row.name.replace("_", " ").capitalize())


class NodeCredentialInline(ReadOnlyInline):
    model = NodeCredential
    fields = ["prefix", "issuer", "agent_version", "issued_at", "expires_at", "rotated_at", "revoked_at"]


class NodeHoldInline(ReadOnlyInline):
    """Every cordon hold of the node, active ones first (removed ones stay as the record)."""

    model = NodeHold
    verbose_name = "cordon hold"
    fields = [
        "owner",
        "reason",
        "created_at",
        "created_by_name",
        "expires_at",
        "removed_at",
        "removed_by_name",
        "forced",
    ]
    ordering = [F("removed_at").desc(nulls_first=True), "-created_at"]


class DeviceInline(ReadOnlyInline):
    """The node's devices (fleet.devices): live ones first, retired ones kept as history."""

    model = Device
    verbose_name = "device"
    fields = [
        "device_id", "type", "index", "model", "memory_bytes", "interconnect_group", "numa_node",
        "health", "verified_at", "held", "taints", "retired_at", "retired_reason",
    ]  # fmt: skip
    ordering = [F("retired_at").desc(nulls_first=True), "type", "index"]


@admin.register(Reverification)
class ReverificationAdmin(OperatorOnlyAdmin):
    """Scheduled re-verifications (fleet.reverification), read-only: the record of each check.
    Operators only: ``due_at`` is what a node must never learn in advance."""

    list_display = ["node", "pool", "state", "due_at", "started_at", "finished_at", "mode", "code"]
    list_filter = ["state", "code", "pool"]
    search_fields = ["node__hostname", "=node__id"]
    readonly_fields = [f.name for f in Reverification._meta.fields]
    date_hierarchy = "due_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Device)
class DeviceAdmin(OperatorOnlyAdmin):
    """Devices across the fleet; actions: verify, release a held device (fleet.devices services)."""

    list_display = ["device_id", "node", "type", "index", "model", "health", "verified_at", "held", "retired_at"]
    list_filter = ["type", "health", "held"]
    search_fields = ["device_id", "serial", "node__hostname"]
    readonly_fields = [f.name for f in Device._meta.fields]
    actions = ["verify_devices", "release_devices"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Verify the selected devices (they become allocatable if healthy)")
    def verify_devices(self, request, queryset):
        actor = Actor.from_request(request)
        done = 0
        for row in queryset.filter(retired_at__isnull=True):
            device_verify(node_id=row.node_id, device_id=row.device_id, actor=actor, reason="verified in the admin")
            done += 1
        self.message_user(request, f"{done} device(s) verified.")

    @admin.action(description="Release the selected held devices")
    def release_devices(self, request, queryset):
        actor = Actor.from_request(request)
        done = 0
        for row in queryset.filter(retired_at__isnull=True, held=True):
            device_release(node_id=row.node_id, device_id=row.device_id, actor=actor, reason="released in the admin")
            done += 1
        self.message_user(request, f"{done} device(s) released.")


class NodeChangeList(ChangeList):
    """The node list, with each row's free devices by model read for the whole page at once."""

    def get_results(self, request):
        super().get_results(request)
        summary = device_summary([node.pk for node in self.result_list])
        for node in self.result_list:
            node.free_devices_text = free_devices_text(summary.get(node.pk, {}))


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Operators: the fleet at a glance, a node page in sections, actions as buttons. Owners: their
    own nodes, read-only. Actions of higher apps (cordon, drain…) are added by maintenance.admin."""

    # Laid out to read at a glance at 1440 px (issue 33 item 5; tests/browser/test_console_layout.py):
    # the id under the hostname, the heartbeat age under the liveness, free capacity in one cell,
    # every unschedulable reason in full (the column wraps).
    list_display = [
        "hostname_cell", "pool", "lifecycle_cell", "liveness_cell", "readiness_cell", "health_cell",
        "schedulable_cell", "free_cell",
    ]  # fmt: skip
    list_display_links = ["hostname_cell"]
    list_filter = [
        "pool", "lifecycle", "liveness", "health", SchedulableFilter, UnschedulableReasonFilter, ("owner", OwnerFilter),
    ]  # fmt: skip
    ordering = ["pool__name", "hostname"]
    search_fields = ["hostname", "display_name"]
    list_select_related = ["pool", "owner"]
    actions = ["admit_nodes", "allow_takeover"]
    inlines = [DeviceInline, NodeHoldInline, AdmissionCheckInline, NodeCredentialInline]
    change_form_template = "admin/fleet/node/node_page.html"

    class Media:
        css = {"all": ["fleet/admin/nodepool.css"]}
        js = ["fleet/admin/copy.js"]

    @admin.display(description="hostname", ordering="hostname")
    def hostname_cell(self, node):
        """The hostname (the row's link), with the short id and its copy button under it."""
        return format_html('{}<br><span class="np-id-line">{}</span>', str(node), short_id(node))

    @admin.display(description="lifecycle", ordering="lifecycle")
    def lifecycle_cell(self, node):
        return state_badge("lifecycle", node.lifecycle)

    @admin.display(description="liveness", ordering="liveness")
    def liveness_cell(self, node):
        return liveness_cell(node)

    @admin.display(description="readiness")
    def readiness_cell(self, node):
        return readiness_badge(node)

    @admin.display(description="health", ordering="health")
    def health_cell(self, node):
        return health_badge(node)

    @admin.display(description="schedulable")
    def schedulable_cell(self, node):
        return schedulable_cell(node)

    @admin.display(description="free", ordering="free_cpu")
    def free_cell(self, node):
        return free_cell(node)

    def get_changelist(self, request, **kwargs):
        return NodeChangeList

    def changelist_view(self, request, extra_context=None):
        # The node list needs the page's width at 1440 px: no navigation sidebar (the index and the
        # breadcrumbs lead everywhere it did).
        extra_context = {"is_nav_sidebar_enabled": False, **(extra_context or {})}
        return super().changelist_view(request, extra_context)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        node = self.get_object(request, unquote(object_id))
        extra_context = {"is_nav_sidebar_enabled": False, **(extra_context or {})}
        if node is not None:
            extra_context["node_sections"] = node_sections(request, node)
            extra_context["title"] = f"Node {node}"
            extra_context["subtitle"] = None  # the title names the node already
        return super().change_view(request, object_id, form_url, extra_context)

    def get_fields(self, request, obj=None):
        return []  # the node page draws its own sections (node_page.html), not a form of raw fields

    def response_action(self, request, queryset):
        """After an action started from the node page, go back to that node's page."""
        response = super().response_action(request, queryset)
        back = request.POST.get("_node_page", "")
        safe = back.startswith(reverse("admin:fleet_node_changelist")) and url_has_allowed_host_and_scheme(
            back, allowed_hosts={request.get_host()}
        )
        if isinstance(response, HttpResponseRedirect) and safe:
            return HttpResponseRedirect(back)
        return response

    def get_queryset(self, request):
        qs = annotate_free(super().get_queryset(request).select_related("pool", "owner"))
        active_holds = NodeHold.objects.filter(removed_at__isnull=True).order_by("created_at", "pk")
        qs = qs.annotate(has_valid_credential=valid_credential_exists()).prefetch_related(
            Prefetch("holds", queryset=active_holds, to_attr="prefetched_active_holds")
        )
        return qs if is_operator(request.user) else qs.filter(owner=request.user)

    def get_readonly_fields(self, request, obj=None):
        return ["schedulable", "reported_readiness", *[f.name for f in Node._meta.fields]]

    @admin.display(description="schedulable")
    def schedulable(self, node: Node) -> str:
        """``yes``, or ``no`` with the reason codes (fleet.selectors.unschedulable_reasons)."""
        reasons = unschedulable_reasons(node)
        if not reasons:
            return "yes"
        return "no: " + ", ".join(r["code"] for r in reasons)

    @admin.display(description="readiness (reported by the node)")
    def reported_readiness(self, node: Node) -> str:
        """The node's own word and when it said it (its last status report, not its last renewal)
        — never a verdict (see schedulable)."""
        if node.last_status_report_at is None:
            return "never reported"
        said = "ready" if node.ready else f"not ready ({node.ready_reason})" if node.ready_reason else "not ready"
        return f"{said}, reported {node.last_status_report_at:%Y-%m-%d %H:%M:%S} UTC"

    def get_actions(self, request):
        # Every node action is an operator's (admit, cordon, drain, quarantine…): owners get none,
        # so their node list shows no action menu at all.
        return super().get_actions(request) if is_operator(request.user) else {}

    def get_inline_instances(self, request, obj=None):
        """The node's record tables that have rows (an empty "Devices" table says nothing), and no
        credentials for owners."""
        inlines = super().get_inline_instances(request, obj)
        if obj is not None:
            inlines = [i for i in inlines if i.model.objects.filter(node=obj).exists()]
        if is_operator(request.user):
            return inlines
        return [i for i in inlines if not isinstance(i, NodeCredentialInline)]

    def get_list_filter(self, request):
        if is_operator(request.user):
            return self.list_filter
        return ["lifecycle", "liveness", "health", SchedulableFilter]

    def get_search_results(self, request, queryset, search_term):
        """Search also by node id (a UUID) and by label (``key=value`` on platform or node labels)."""
        term = search_term.strip()
        try:
            return queryset.filter(pk=uuid.UUID(term)), False
        except ValueError:
            pass
        key, eq, value = term.partition("=")
        if eq and key:
            try:
                platform = _label_filter(queryset, [term], PLACEMENT)
                declared = _label_filter(queryset, [term], NODE_DECLARED)
            except Problem:
                return queryset.none(), False
            return (platform | declared).distinct(), True
        return super().get_search_results(request, queryset, search_term)

    def has_module_permission(self, request):
        return is_operator(request.user) or is_owner(request.user)

    def has_view_permission(self, request, obj=None):
        if is_operator(request.user):
            return True
        return is_owner(request.user) and (obj is None or obj.owner_id == request.user.pk)

    def has_add_permission(self, request):
        return False  # nodes enroll themselves with a bootstrap token

    def has_change_permission(self, request, obj=None):
        return False  # state changes are actions (admit here; cordon, drain... in maintenance)

    def has_delete_permission(self, request, obj=None):
        return False  # nodes are retired, never deleted: identity and history stay

    def has_admit_permission(self, request):
        return is_operator(request.user)

    @admin.action(description="Admit selected nodes (run admission checks)", permissions=["admit"])
    def admit_nodes(self, request, queryset):
        """Two steps: a confirmation page records the version of each node as shown, then admission
        runs against exactly those versions, so a node changed in between is refused (412), not admitted."""
        if request.POST.get("confirm") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Admit nodes",
                "opts": self.model._meta,
                "nodes": list(queryset),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
                "action": "admit_nodes",
            }
            return TemplateResponse(request, "admin/fleet/node/admit_confirmation.html", context)
        actor = Actor.from_request(request)
        reason = request.POST.get("reason", "")[:1000]
        admitted = 0
        for node in queryset:
            try:
                expected = int(request.POST.get(f"version_{node.pk}", ""))
                services.node_admit(node_id=node.pk, expected_version=expected, actor=actor, reason=reason)
                admitted += 1
            except ValueError:
                self.message_user(request, f"{node}: no version was confirmed.", messages.ERROR)
            except Problem as exc:
                self.message_user(request, f"{node}: {exc.detail}", messages.ERROR)
        if admitted:
            self.message_user(request, f"Admission started for {admitted} node(s).", messages.SUCCESS)
        return None

    @admin.action(description="Allow an agent to take over (a one-hour bootstrap token naming the node)",
                  permissions=["admit"])  # fmt: skip
    def allow_takeover(self, request, queryset):
        """One bootstrap token per selected node, naming it (fleet.takeover), used once, valid one
        hour; each secret is shown once. For an imported node's first agent, or an agent whose
        credential expired or was revoked (docs/fleet.md, "Recovering a revoked or expired credential")."""
        expires_at = timezone.now() + timezone.timedelta(hours=1)
        for node in queryset:
            try:
                _, secret = services.bootstrap_token_create(
                    pool=None, node_id=node.pk, expires_at=expires_at, created_by=request.user,
                    description=f"take over {node}",
                )  # fmt: skip
            except Problem as exc:
                self.message_user(request, f"{node}: {exc.detail}", messages.ERROR)
                continue
            self.message_user(
                request,
                f"{node}: bootstrap token naming it (copy it now, it will not be shown again; valid 1 h): {secret}",
                messages.WARNING,
            )
        return None
