"""Maintenance's sections of the node page: the action buttons (each with its reason and the
node's version as read), and the node's current drain, quarantine and holds, linked.

Registered into :mod:`fleet.admin_sections` when maintenance's admin module is imported.
"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.urls import reverse
from django_fsm import can_proceed

from fleet.admin_sections import NodeSection, register_node_section
from fleet.choices import Lifecycle
from fleet.events import Actor
from nodepool.api.permissions import is_operator

from .choices import DrainState
from .holds import active_holds, owner_for
from .models import Drain, Quarantine
from .selectors import public_evidence

# (admin action, button label, may it apply to this node?, permission, what the form asks for).
# "form" actions open the action's own page (drain: /admin/fleet/node/<id>/drain/, deadline, policy
# and a dry-run preview). "repair": a node left draining with no drain (drains.repair_stuck_drain).
BUTTONS = [
    ("cordon_nodes", "Cordon", lambda node: node.lifecycle != Lifecycle.RETIRED, "fleet.operate_node", "cordon"),
    ("uncordon_nodes", "Uncordon", lambda node: node.cordoned, "fleet.operate_node", "uncordon"),
    ("drain_nodes", "Drain…", lambda node: can_proceed(node.drain), "fleet.operate_node", "form"),
    ("quarantine_nodes", "Quarantine", lambda node: can_proceed(node.quarantine), "fleet.quarantine_node", "evidence"),
    ("release_nodes", "Release", lambda node: can_proceed(node.release), "fleet.release_node", "reason"),
    ("return_nodes_to_service", "Return to service", lambda node: can_proceed(node.return_to_service),
     "fleet.operate_node", "reason"),
    ("retire_nodes", "Retire", lambda node: can_proceed(node.retire), "fleet.operate_node", "reason"),
    ("repair_stuck_drains", "Finish a lost drain", lambda node: _drain_lost(node), "fleet.operate_node", "repair"),
]  # fmt: skip
FORM_URLS = {"drain_nodes": "admin-node-drain"}


def _drain_lost(node) -> bool:
    """Draining with no active drain: nothing will ever finish it (drains.repair_stuck_drain)."""
    if node.lifecycle != Lifecycle.DRAINING:
        return False
    return not Drain.objects.filter(node=node, state=DrainState.ACTIVE).exists()


def _actions(request, node) -> dict | None:
    if not is_operator(request.user):
        return None
    buttons = [
        {
            "action": action,
            "label": label,
            "kind": kind,
            "url": reverse(FORM_URLS[action], args=[node.pk]) if action in FORM_URLS else "",
        }
        for action, label, applies, permission, kind in BUTTONS
        if request.user.has_perm(permission) and applies(node)
    ]
    own = owner_for(Actor.from_request(request))
    holds = active_holds(node)
    return {
        "buttons": buttons,
        "changelist": reverse("admin:fleet_node_changelist"),
        "node_page": reverse("admin:fleet_node_change", args=[node.pk]),
        "checkbox": ACTION_CHECKBOX_NAME,
        "node": node,
        "own_hold": own,
        "has_own_hold": any(h.owner == own for h in holds),
        "other_holds": [h.owner for h in holds if h.owner != own],
    }


def _link(request, obj) -> str:
    """The admin page of ``obj`` when this user may open it, else "" (no dead links for owners)."""
    if obj is None:
        return ""
    model_admin = admin.site._registry.get(type(obj))
    if model_admin is None or not model_admin.has_view_permission(request, obj):
        return ""
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])


def _maintenance(request, node) -> dict:
    drain = Drain.objects.filter(node=node, state=DrainState.ACTIVE).order_by("-created_at").first()
    last_drain = drain or Drain.objects.filter(node=node).order_by("-created_at").first()
    quarantine = Quarantine.objects.filter(node=node, released_at__isnull=True).order_by("-created_at").first()
    return {
        "drain": last_drain,
        "drain_active": drain is not None,
        "drain_url": _link(request, last_drain),
        "quarantine": quarantine,
        "quarantine_url": _link(request, quarantine),
        # Owners read it without what operators marked private (selectors.public_evidence).
        "evidence": sorted(
            (quarantine.evidence if is_operator(request.user) else public_evidence(quarantine.evidence)).items()
        )
        if quarantine
        else [],
        "holds": active_holds(node),
    }


register_node_section(NodeSection("actions", "Actions", 15, "admin/maintenance/node_actions.html", _actions))
register_node_section(
    NodeSection(
        "maintenance", "Drain, quarantine and holds", 60, "admin/maintenance/node_maintenance.html", _maintenance
    )  # fmt: skip
)
