"""The node page's *Reliability* section (docs/fleet.md, "Reliability"): the score placement
compares, uptime and leases completed against node-fault losses per window, their causes, faults
per device and re-verification runs. Shown to operators and the node's owner alike: it describes
the machine, not its owner."""

from __future__ import annotations

from .admin_display import badge
from .admin_sections import NodeSection, register_node_section
from .reliability import record


def _percent(value) -> str:
    return "—" if value is None else f"{100 * value:.2f} %"


def _reliability(request, node) -> dict:
    shown = record(node)
    score = shown["reliability"]
    if score is None:
        headline = badge("unrated", "muted", f"fewer than {shown['min_sample']} counted leases")
    else:
        headline = badge(f"{score:.4f}", "ok" if score >= 0.99 else ("warn" if score >= 0.9 else "bad"))
    rows = [
        {
            "window": name,
            "uptime": _percent(w["uptime"]),
            "completed": w["leases_completed"],
            "node_fault": w["leases_node_fault"],
            "causes": ", ".join(f"{cause} {n}" for cause, n in w["leases_node_fault_by_cause"].items() if n) or "—",
            "reliability": "—" if w["reliability"] is None else f"{w['reliability']:.4f}",
        }
        for name, w in shown["windows"].items()
    ]
    return {"record": shown, "headline": headline, "rows": rows}


register_node_section(
    NodeSection("reliability", "Reliability", 35, "admin/fleet/node/section_reliability.html", _reliability)
)
