"""Admin pages outside a model's change list: the fleet overview (linked from the admin index)."""

from __future__ import annotations

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse
from django.utils import timezone

from fleet import conf as fleet_conf
from fleet import fleet_state
from nodepool.api.permissions import is_operator

from .overview import fleet_overview


def fleet_overview_view(request):
    """``/admin/fleet-overview/``: operators only (owners see their own nodes, not the fleet)."""
    if not is_operator(request.user):
        raise PermissionDenied
    now = timezone.now()
    pools = fleet_overview(now=now)
    for entry in pools:
        entry["state_tables"] = [
            ("lifecycle", entry["lifecycle"]),
            ("liveness", entry["liveness"]),
            ("health", entry["health"]),
        ]
        for row in entry["capacity"]:
            row["bar_width"] = min(100.0, row["percent"])
    context = {
        **admin.site.each_context(request),
        "title": "Fleet overview",
        "pools": pools,
        "now": now,
        "state_at": pools[0]["state_at"] if pools else None,
        "state_interval": fleet_state.interval(),
        # What the guard is, in the overview's own words (docs/heartbeats.md, "Mass silence" and
        # "Clock jumps"): the thresholds are the settings the sweep uses.
        "guard_fraction_percent": round(100 * fleet_conf.get("UNHEALTHY_ZONE_FRACTION")),
        "guard_min_nodes": fleet_conf.get("UNHEALTHY_ZONE_MIN_NODES"),
        "clock_jump_seconds": fleet_conf.get("CLOCK_JUMP_THRESHOLD"),
    }
    return TemplateResponse(request, "admin/fleet_overview.html", context)
