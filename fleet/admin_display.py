"""What the node list and the node page draw: state badges, ages, free capacity, list filters,
and the fleet app's own sections of the node page (summary, capability, resources, conditions,
events). Other apps add sections through :mod:`fleet.admin_sections`.
"""

from __future__ import annotations

from datetime import datetime

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import F, OuterRef, Subquery, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone
from django.utils.html import format_html

from nodepool.api.permissions import OWNERS
from nodepool.quantity import CPU, MEMORY, humanize_quantity

from .admin_sections import NodeSection, register_node_section
from .choices import Health, Lifecycle, Liveness
from .models import Node, NodeEvent, NodeResource
from .selectors import UNSCHEDULABLE_REASON_LABELS, schedulable_q, unschedulable_reason_q, unschedulable_reasons

GPU = "nvidia.com/gpu"
TIMELINE_EVENTS = 50

# Badge tone per state value: ok (green), warn (amber), bad (red), muted (grey).
TONES = {
    "lifecycle": {
        Lifecycle.READY: "ok",
        Lifecycle.DRAINING: "warn",
        Lifecycle.MAINTENANCE: "warn",
        Lifecycle.QUARANTINED: "bad",
        Lifecycle.REJECTED: "bad",
    },
    "liveness": {Liveness.ALIVE: "ok", Liveness.STALE: "warn", Liveness.UNREACHABLE: "bad", Liveness.LOST: "bad"},
    "health": {Health.HEALTHY: "ok", Health.DEGRADED: "warn", Health.UNHEALTHY: "bad"},
}


def badge(text: str, tone: str = "muted", title: str = ""):
    return format_html('<span class="np-badge np-{}" title="{}">{}</span>', tone, title, text)


def state_badge(dimension: str, value: str):
    return badge(value, TONES[dimension].get(value, "muted"))


def age(moment: datetime | None, now: datetime | None = None) -> str:
    """``"12 s ago"``, ``"5 min ago"``, ``"3 h ago"``, ``"2 d ago"``; ``"never"`` for None."""
    if moment is None:
        return "never"
    seconds = max(0, int(((now or timezone.now()) - moment).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def free_annotation(resource: str):
    """Free amount of ``resource`` on each node (allocatable − allocated, never below 0), or None."""
    rows = NodeResource.objects.filter(node=OuterRef("pk"), name=resource)
    free = rows.annotate(free=Greatest(F("allocatable") - F("allocated"), Value(0))).values("free")[:1]
    return Subquery(free)


def annotate_free(queryset):
    return queryset.annotate(free_cpu=free_annotation(CPU), free_memory=free_annotation(MEMORY)).annotate(
        free_gpu=Coalesce(free_annotation(GPU), Value(0))
    )


def short_id(node: Node):
    """The node id's first 8 characters, with a button that copies the whole id."""
    full = str(node.pk)
    return format_html(
        '<code class="np-id" title="{}">{}</code> '
        '<button type="button" class="np-copy" data-copy="{}" title="Copy the node id" aria-label="Copy id {}">'
        "copy</button>",
        full,
        full[:8],
        full,
        full[:8],
    )


def schedulable_cell(node: Node):
    reasons = unschedulable_reasons(node)
    if not reasons:
        return badge("yes", "ok")
    more = f" (+{len(reasons) - 1})" if len(reasons) > 1 else ""
    title = "; ".join(r["message"] for r in reasons)
    return format_html("{} <span class='np-reason' title='{}'>{}{}</span>", badge("no", "bad"), title,
                       reasons[0]["message"], more)  # fmt: skip


# --- list filters ----------------------------------------------------------------------------------------


class SchedulableFilter(admin.SimpleListFilter):
    title = "schedulable"
    parameter_name = "schedulable"

    def lookups(self, request, model_admin):
        return [("yes", "yes"), ("no", "no")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(schedulable_q())
        if self.value() == "no":
            return queryset.exclude(schedulable_q())
        return queryset


class UnschedulableReasonFilter(admin.SimpleListFilter):
    title = "unschedulable reason"
    parameter_name = "unschedulable"

    def lookups(self, request, model_admin):
        return list(UNSCHEDULABLE_REASON_LABELS.items())

    def queryset(self, request, queryset):
        if self.value() in UNSCHEDULABLE_REASON_LABELS:
            return queryset.filter(unschedulable_reason_q(self.value()))
        return queryset


class OwnerFilter(admin.RelatedFieldListFilter):
    """The node's owner, offering marketplace owners only (not every user of the system)."""

    def field_choices(self, field, request, model_admin):
        owners = get_user_model().objects.filter(groups__name=OWNERS).order_by("username")
        return [(user.pk, user.get_username()) for user in owners]


# --- the fleet app's sections of the node page -------------------------------------------------------------


def _summary(request, node: Node) -> dict:
    reasons = unschedulable_reasons(node)
    return {
        "badges": [
            ("lifecycle", state_badge("lifecycle", node.lifecycle)),
            ("liveness", state_badge("liveness", node.liveness)),
            ("readiness", badge("ready", "ok") if node.ready else badge("not ready", "warn", node.ready_reason)),
            ("health", state_badge("health", node.health)),
            ("cordon", badge("cordoned", "warn") if node.cordoned else badge("no holds", "muted")),
            ("schedulable", badge("yes", "ok") if not reasons else badge("no", "bad")),
        ],
        "reasons": reasons,
        "rows": [
            ("id", node.pk),
            ("pool", node.pool),
            ("owner", node.owner or "—"),
            ("addresses", ", ".join(node.addresses or []) or "—"),
            ("lifecycle reason", node.lifecycle_reason or "—"),
            ("last heartbeat", f"{age(node.last_heartbeat_at)} ({node.last_heartbeat_at or '—'})"),
            # Renewals keep liveness fresh; readiness, health and usage are as old as the last report.
            ("last status report", f"{age(node.last_status_report_at)} ({node.last_status_report_at or '—'})"),
            ("agent", f"{node.agent_version or '—'}, incarnation {node.incarnation}, sequence {node.sequence}"),
            ("artifacts blocked", "yes" if node.artifacts_blocked else "no"),
            ("version", node.version),
        ],
        "labels": sorted({**(node.node_labels or {}), **(node.labels or {})}.items()),
        "taints": node.taints or [],
    }


def _capability(request, node: Node) -> dict:
    kinds = ("declared", "measured", "verified")
    sources = {kind: (getattr(node, kind) or {}) for kind in kinds}
    names = sorted({name for source in sources.values() for name in (source.get("resources") or {})})
    rows = [
        (name, [humanize_quantity(name, (sources[kind].get("resources") or {}).get(name)) for kind in kinds])
        for name in names
    ]
    features = sorted({key for source in sources.values() for key in (source.get("features") or {})})
    feature_rows = [
        (key, [_plain((sources[kind].get("features") or {}).get(key)) for kind in kinds]) for key in features
    ]
    accelerators = [
        (kind, f"{a.get('count', 1)} × {a.get('model') or a.get('type')}", humanize_quantity(MEMORY, a.get("memory")))
        for kind in kinds
        for a in sources[kind].get("accelerators") or []
        if isinstance(a, dict)
    ]
    return {"kinds": kinds, "rows": rows, "features": feature_rows, "accelerators": accelerators}


def _plain(value) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "—"
    return str(value)


def _resources(request, node: Node) -> dict:
    rows = []
    for r in sorted(node.resources.all(), key=lambda r: r.name):
        amounts = (r.capacity, r.reserved, r.allocatable, r.allocated, r.free)
        rows.append((r.name, [humanize_quantity(r.name, v) for v in amounts], r.overcommitted))
    return {"rows": rows}


def _conditions(request, node: Node) -> dict:
    rows = []
    for c in node.conditions or []:
        if isinstance(c, dict):
            status = str(c.get("status", ""))
            tone = "ok" if (status == "True") == (c.get("type") == "Ready") else "bad"
            tone = "muted" if status not in ("True", "False") else tone
            rows.append({**c, "badge": badge(status or "?", tone)})
    return {"rows": rows}


def _events(request, node: Node) -> dict:
    events = NodeEvent.objects.filter(node=node).order_by("-created_at", "-id")[:TIMELINE_EVENTS]
    return {"events": list(events), "limit": TIMELINE_EVENTS}


for _section in (
    NodeSection("summary", "Summary", 10, "admin/fleet/node/section_summary.html", _summary),
    NodeSection("capability", "Capability", 20, "admin/fleet/node/section_capability.html", _capability),
    NodeSection("resources", "Resources", 30, "admin/fleet/node/section_resources.html", _resources),
    NodeSection("conditions", "Conditions", 40, "admin/fleet/node/section_conditions.html", _conditions),
    NodeSection("events", "Events", 90, "admin/fleet/node/section_events.html", _events),
):
    register_node_section(_section)
