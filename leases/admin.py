"""Admin for leases (read-mostly: capacity moves only through services), shapes and requests."""

from django.contrib import admin, messages
from django.db.models import Max
from django.urls import reverse
from django.utils import timezone

import humanunits
from fleet.admin_display import badge
from fleet.admin_sections import NodeSection, register_node_section
from fleet.events import Actor
from nodepool.admin_mixins import AppendOnlyAdminMixin, ReadOnlyRecordAdminMixin

from . import fencing, lifecycle
from .choices import LIVE_LEASE_STATES, LeaseState
from .models import ConsistencyReport, EvidenceInterval, FencingSequence, Lease, LeaseCheckpoint, LeaseRequest, Shape


class _ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class EvidenceIntervalInline(_ReadOnlyInline):
    """Execution evidence (docs/marketplace.md): when the node listed this lease as running."""

    model = EvidenceInterval
    fields = (
        "started_at",
        "last_seen_at",
        "closed_at",
        "close_reason",
        "node_incarnation",
        "fencing_token",
        "status_reports",
        "renewals",
        "usage_max",
        "devices",
    )
    readonly_fields = fields


class LeaseCheckpointInline(_ReadOnlyInline):
    model = LeaseCheckpoint
    fields = ("state", "requested_at", "requested_by", "taken_at", "message", "fencing_token", "node_incarnation")
    readonly_fields = fields


@admin.register(Shape)
class ShapeAdmin(admin.ModelAdmin):
    list_display = ("name", "version", "resources", "features", "created_at")
    list_filter = ("name",)
    search_fields = ("name",)
    readonly_fields = ("version", "created_at")

    def save_model(self, request, obj, form, change):
        # Shapes are versioned: an edit publishes a new version, the old one stays for its leases.
        latest = Shape.objects.filter(name=obj.name).aggregate(v=Max("version"))["v"] or 0
        if change:
            obj.pk = None
        obj.version = latest + 1
        super().save_model(request, obj, form, False)


@admin.register(Lease)
class LeaseAdmin(ReadOnlyRecordAdminMixin, admin.ModelAdmin):
    list_display = ("id", "workload_id", "fencing_token", "node", "pool", "state", "workload_state", "expires_at")
    list_filter = ("state", "workload_state", "pool")
    search_fields = ("id", "workload_id", "node__hostname", "group")
    date_hierarchy = "granted_at"
    actions = ["revoke", "request_checkpoint"]
    list_select_related = ("node", "pool")
    inlines = (EvidenceIntervalInline, LeaseCheckpointInline)

    # Leases are granted by placement only (capacity must move with them) and ended by services.
    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Lease._meta.fields]

    @admin.action(description="Revoke selected live leases (their capacity returns)")
    def revoke(self, request, queryset):
        actor = Actor.from_request(request)
        count = 0
        for lease_id in queryset.filter(state__in=LIVE_LEASE_STATES).values_list("pk", flat=True):
            if lifecycle.end_lease(
                lease_id,
                to_state=LeaseState.REVOKED,
                actor=actor,
                now=timezone.now(),
                reason=f"revoked in the admin by {actor.name}",
            ):
                count += 1
        self.message_user(request, f"{count} lease(s) revoked.", messages.SUCCESS)

    @admin.action(description="Ask the node to checkpoint selected leases")
    def request_checkpoint(self, request, queryset):
        actor = Actor.from_request(request)
        count = sum(fencing.request_checkpoint(lease=lease, actor=actor) for lease in queryset)
        self.message_user(request, f"{count} checkpoint request(s) sent.", messages.SUCCESS)


@admin.register(LeaseRequest)
class LeaseRequestAdmin(AppendOnlyAdminMixin, admin.ModelAdmin):
    """Append-only; an operator may change a queued request's priority (the one editable field)."""

    list_display = ("id", "workload_id", "pool", "state", "priority", "created_at", "placed_at", "attempts")
    list_filter = ("state", "pool")
    search_fields = ("id", "workload_id")
    readonly_fields = [f.name for f in LeaseRequest._meta.fields if f.name != "priority"]


@admin.register(FencingSequence)
class FencingSequenceAdmin(ReadOnlyRecordAdminMixin, admin.ModelAdmin):
    list_display = ("workload_id", "last_token")
    search_fields = ("workload_id",)
    readonly_fields = ("workload_id", "last_token")


@admin.register(ConsistencyReport)
class ConsistencyReportAdmin(ReadOnlyRecordAdminMixin, admin.ModelAdmin):
    list_display = ("checked_at", "nodes_checked", "repaired", "drift")
    readonly_fields = ("checked_at", "nodes_checked", "drift", "repaired")


# --- the node page's leases section (fleet.admin_sections: fleet never imports leases) ----------------------
ENDED_ON_NODE_PAGE = 10


def _node_leases(request, node) -> dict:
    live = list(Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).order_by("granted_at"))
    ended = list(
        Lease.objects.filter(node=node).exclude(state__in=LIVE_LEASE_STATES).order_by("-ended_at")[:ENDED_ON_NODE_PAGE]
    )
    lease_admin = admin.site._registry.get(Lease)
    rows = []
    for lease in live + ended:
        linked = lease_admin is not None and lease_admin.has_view_permission(request, lease)
        rows.append(
            {
                "lease": lease,
                "url": reverse("admin:leases_lease_change", args=[lease.pk]) if linked else "",
                "state": badge(lease.state, "ok" if lease.state in LIVE_LEASE_STATES else "muted"),
                "resources": ", ".join(
                    f"{name} {humanunits.quantity(name, amount)}" for name, amount in sorted(lease.resources.items())
                ),
            }
        )
    return {"rows": rows, "live": len(live), "ended_shown": len(ended)}


register_node_section(NodeSection("leases", "Leases", 50, "admin/leases/node_leases.html", _node_leases))
