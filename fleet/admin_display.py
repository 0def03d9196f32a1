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
from django.utils.html import format_html, format_html_join

import humanunits
from nodepool.api.permissions import OWNERS
from nodepool.quantity import CPU, MEMORY

from .admin_sections import NodeSection, register_node_section
from .choices import Health, Lifecycle, Liveness, Readiness
from .models import Node, NodeEvent, NodeResource
from .readiness import health_state, readiness_state
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


def readiness_badge(node: Node):
    """Readiness as shown (fleet.readiness): ``ready`` green, ``not ready`` amber, ``unknown`` grey
    once the node is unreachable, lost or never heard from — the last reported value in the tooltip."""
    shown = readiness_state(liveness=node.liveness, ready=node.ready)
    if shown == Readiness.UNKNOWN:
        said = "ready" if node.ready else "not ready"
        return badge("unknown", "muted", f"no current report; last reported {said}")
    if shown == Readiness.READY:
        return badge("ready", "ok")
    return badge("not ready", "warn", node.ready_reason)


def health_badge(node: Node):
    """Health as shown (fleet.readiness): grey ``unknown`` once signals are not current, with the
    last judged value in the tooltip; otherwise the judged health's own tone."""
    shown = health_state(liveness=node.liveness, health=node.health)
    if shown == Health.UNKNOWN and node.health != Health.UNKNOWN:
        return badge("unknown", "muted", f"no current report; last judged {node.health}")
    return state_badge("health", shown)


def age(moment: datetime | None, now: datetime | None = None) -> str:
    """``"45s ago"``, ``"5m30s ago"``, ``"3h12m ago"`` (kubectl's ages, humanunits.duration);
    ``"never"`` for None."""
    if moment is None:
        return "never"
    return f"{humanunits.age(moment, now or timezone.now())} ago"


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
    """``yes``, or ``no`` with every reason written out in full, one per line (no "(+4)", nothing
    cut: the column wraps)."""
    reasons = unschedulable_reasons(node)
    if not reasons:
        return badge("yes", "ok")
    lines = format_html_join("", '<li title="{}">{}</li>', ((r["code"], r["message"]) for r in reasons))
    return format_html('{} <ul class="np-reasons-cell">{}</ul>', badge("no", "bad"), lines)


def liveness_cell(node: Node):
    """The liveness badge and, under it, how long ago the last heartbeat arrived: ``heard 12s ago``
    or ``never heard`` (the absolute time on hover)."""
    when = humanunits.timestamp(node.last_heartbeat_at) if node.last_heartbeat_at else "never heard from"
    return format_html(
        '{}<br><span class="np-age" title="last heartbeat {}">{}</span>',
        state_badge("liveness", node.liveness),
        when,
        f"heard {age(node.last_heartbeat_at)}" if node.last_heartbeat_at else "never heard",
    )


def free_cell(node: Node):
    """Free capacity in one cell: cpu · memory, then the free GPUs (by model when the node reports
    devices: ``5×H100 …``, fleet.devices.free_devices_text), in Kubernetes units (humanunits), e.g.
    ``40 cpu · 128Gi`` / ``5×H100``."""
    cpu_memory = format_html(
        "{} cpu · {}", humanunits.quantity(CPU, node.free_cpu), humanunits.quantity(MEMORY, node.free_memory)
    )
    by_model = getattr(node, "free_devices_text", "")
    if by_model:
        devices = format_html('<span class="np-devices" title="free devices by model">{}</span>', by_model)
        return format_html("{}<br>{}", cpu_memory, devices)
    if node.free_gpu:
        return format_html("{}<br>{} gpu", cpu_memory, humanunits.quantity(GPU, node.free_gpu))
    return cpu_memory


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
            ("readiness", readiness_badge(node)),
            ("health", health_badge(node)),
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
            ("last heartbeat", humanunits.moment(node.last_heartbeat_at)),
            # Renewals keep liveness fresh; readiness, health and usage are as old as the last report.
            ("last status report", humanunits.moment(node.last_status_report_at)),
            ("last reported", _last_reported(node)),
            ("agent", f"{node.agent_version or '—'}, incarnation {node.incarnation}, sequence {node.sequence}"),
            ("artifacts blocked", "yes" if node.artifacts_blocked else "no"),
            ("version", node.version),
        ],
        "labels": sorted({**(node.node_labels or {}), **(node.labels or {})}.items()),
        "taints": node.taints or [],
    }


def _last_reported(node: Node) -> str:
    """What the node last said of itself, kept for reference when readiness and health are shown
    ``unknown`` (fleet.readiness): ``"ready, healthy (3h ago)"``."""
    said = "ready" if node.ready else f"not ready ({node.ready_reason})" if node.ready_reason else "not ready"
    if node.last_status_report_at is None and node.last_heartbeat_at is None:
        return "nothing yet"
    return f"{said}, {node.health} (as of {age(node.last_status_report_at or node.last_heartbeat_at)})"


def _capability(request, node: Node) -> dict:
    kinds = ("declared", "measured", "verified")
    sources = {kind: (getattr(node, kind) or {}) for kind in kinds}
    names = sorted({name for source in sources.values() for name in (source.get("resources") or {})})
    rows = [
        (name, [humanunits.quantity(name, (sources[kind].get("resources") or {}).get(name)) for kind in kinds])
        for name in names
    ]
    features = sorted({key for source in sources.values() for key in (source.get("features") or {})})
    feature_rows = [
        (key, [_plain((sources[kind].get("features") or {}).get(key)) for kind in kinds]) for key in features
    ]
    accelerators = [
        (kind, f"{a.get('count', 1)} × {a.get('model') or a.get('type')}", humanunits.quantity(MEMORY, a.get("memory")))
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
        rows.append((r.name, [humanunits.quantity(r.name, v) for v in amounts], r.overcommitted))
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
