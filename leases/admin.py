"""Admin for leases (read-mostly: capacity moves only through services), shapes and requests."""

from django.contrib import admin, messages
from django.db.models import Max

from fleet.events import Actor

from . import services
from .choices import LIVE_LEASE_STATES, LeaseState
from .models import ConsistencyReport, FencingSequence, Lease, LeaseRequest, Shape


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
class LeaseAdmin(admin.ModelAdmin):
    list_display = ("id", "workload_id", "fencing_token", "node", "pool", "state", "workload_state", "expires_at")
    list_filter = ("state", "workload_state", "pool")
    search_fields = ("id", "workload_id", "node__hostname", "group")
    date_hierarchy = "granted_at"
    actions = ["revoke", "request_checkpoint"]
    list_select_related = ("node", "pool")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Lease._meta.fields]

    def has_add_permission(self, request):
        return False  # leases are granted by placement only (capacity must move with them)

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Revoke selected live leases (their capacity returns)")
    def revoke(self, request, queryset):
        from django.utils import timezone

        actor = Actor.from_request(request)
        count = 0
        for lease_id in queryset.filter(state__in=LIVE_LEASE_STATES).values_list("pk", flat=True):
            if services.end_lease(
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
        count = sum(services.request_checkpoint(lease=lease, actor=actor) for lease in queryset)
        self.message_user(request, f"{count} checkpoint request(s) sent.", messages.SUCCESS)


@admin.register(LeaseRequest)
class LeaseRequestAdmin(admin.ModelAdmin):
    list_display = ("id", "workload_id", "pool", "state", "priority", "created_at", "placed_at", "attempts")
    list_filter = ("state", "pool")
    search_fields = ("id", "workload_id")
    readonly_fields = [f.name for f in LeaseRequest._meta.fields if f.name != "priority"]


@admin.register(FencingSequence)
class FencingSequenceAdmin(admin.ModelAdmin):
    list_display = ("workload_id", "last_token")
    search_fields = ("workload_id",)
    readonly_fields = ("workload_id", "last_token")


@admin.register(ConsistencyReport)
class ConsistencyReportAdmin(admin.ModelAdmin):
    list_display = ("checked_at", "nodes_checked", "repaired", "drift")
    readonly_fields = ("checked_at", "nodes_checked", "drift", "repaired")
